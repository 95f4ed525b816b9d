"""Fail (exit 3) on the first attempt and succeed afterwards; record every attempt."""

import os
import sys

out = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"attempt.{os.environ['RANK']}.{attempt}"), "w") as f:
    f.write(os.environ["MASTER_PORT"])
if attempt == "0" and os.environ["RANK"] == "1":
    sys.exit(3)
