"""Write this worker's pid (and a grandchild's) to a file, then sleep until killed."""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(sys.argv[1], f"pids.{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(600)
