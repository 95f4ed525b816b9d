"""Write this worker's environment as JSON to <dir>/env.<RANK>.json (no torch needed)."""

import json
import os
import sys

with open(os.path.join(sys.argv[1], f"env.{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
