"""Run a whole job from Python with `JobRunner`: its master, its nodes on the local engine, its end.

    python examples/run_job.py            # 2 nodes x 1 worker of examples/train_mlp.py

The same job as `dlrover submit --nnodes 2 examples/train_mlp.py --steps 40`, without the CLI:
the runner prints nothing, so this script says what it wants and exits with the job's code.
"""

from __future__ import annotations

import os
import sys
import tempfile

from dlrover.jobspec import job_spec_from_dict
from dlrover.runner import JobRunner, JobRunnerError, RunnerSettings


def main() -> int:
    """Run the job, printing its master's address, each step's node count, and its outcome."""
    if "DLROVER_HOME" not in os.environ:  # the job's record, away from ~/.dlrover
        os.environ["DLROVER_HOME"] = tempfile.mkdtemp(prefix="dlrover_home_")
    here = os.path.dirname(os.path.abspath(__file__))
    spec = job_spec_from_dict(
        {
            "name": "from-python",
            "entrypoint": os.path.join(here, "train_mlp.py"),
            "args": ["--steps", "40", "--log-every", "10"],
            "nodes": 2,
            "engine": "local",
        }
    )
    runner = JobRunner(spec, RunnerSettings(host="127.0.0.1", metrics_port=None))
    try:
        if not runner.start():
            print(f"job {spec.name} had ended already: {runner.outcome()}")
            return 0
    except JobRunnerError as error:
        print(f"cannot run job {spec.name}: {error}", file=sys.stderr)
        return error.exit_code
    print(f"job {spec.name}: master at {runner.master_addr}")
    try:
        while runner.step(0.5):  # one controller iteration: engine events, relaunches
            pass
    finally:
        runner.close()  # nodes removed, master stopped, the job's end recorded
    outcome = runner.outcome()
    print(f"job {spec.name} {outcome.state} (exit code {outcome.exit_code}): {outcome.reason}")
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
