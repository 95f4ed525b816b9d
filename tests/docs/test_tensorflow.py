"""docs/tensorflow.md's "Submit and follow it": the example TensorFlow PS job as written (CI's
extras stage installs tensorflow-cpu)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs.blocks import Shell, doc_block, marker_id, user_env, wait_for

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None,
        reason="tensorflow is not installed (pip install tensorflow-cpu==2.21.0)",
    ),
]

# What the page shows the submit printing, in order ("..." there: a log line's prefix).
PRINTED = [
    r"job wide-deep: 1 chief, 2 ps, 2 worker on engine local; "
    r"`dlrover status wide-deep` to follow it",
    r"tf_controller: cluster spec version 1: \{\"chief\": \[\"127\.0\.0\.1:\d+\"\], \"ps\": ",
    r"tf_controller: ps generation 1: wide-deep-ps-0-0, wide-deep-ps-1-0 serve",
    r"job wide-deep: running -> succeeded \(the chief wide-deep-chief-0-0 succeeded\)",
]


def examples_with_own_out(where: Path, tmp: Path, hold: Path | None = None) -> None:
    """The repository's examples/, with job.yaml's `--out /tmp/wide-deep` in the test's
    directory (a second run must not find the first's checkpoints and data position); with
    ``hold``, the chief waits after each shard while that file exists (the example's
    `--pause-file`), so the job still runs while a test looks at it."""
    (where / "examples" / "tf_ps").mkdir(parents=True)
    for entry in (REPO / "examples").iterdir():
        if entry.name != "tf_ps":
            (where / "examples" / entry.name).symlink_to(entry)
    for entry in (REPO / "examples" / "tf_ps").iterdir():
        target = where / "examples" / "tf_ps" / entry.name
        if entry.name == "job.yaml":
            text = entry.read_text().replace("/tmp/", f"{tmp}/")
            if hold is not None:
                text = text.replace(f"{tmp}/wide-deep]", f"{tmp}/wide-deep, --pause-file, {hold}]")
            target.write_text(text)
        else:
            target.symlink_to(entry)


def test_submit_the_example_job(tmp_path: Path) -> None:
    """Promised: the lines the page shows, in order, `dlrover status wide-deep` showing the
    cluster the master published and a row of each node while it runs, and the chief's output
    in --out."""
    block = doc_block(marker_id(__file__, "test_submit_the_example_job"))
    where, env = tmp_path / "user", user_env(tmp_path)
    hold = tmp_path / "hold"
    hold.touch()  # the job runs (the chief holds after its first shard) until it is seen
    examples_with_own_out(where, tmp_path, hold)
    job = Shell(block.text, where, env, tmp_path / "submit.log")
    try:

        def shows_the_cluster() -> bool:
            done = subprocess.run(
                ["dlrover", "status", "wide-deep"], cwd=where, env=env, capture_output=True,
                text=True, timeout=60,
            )  # fmt: skip
            return bool(
                re.search(r"^tensorflow cluster version 1, ps generation \d+:$", done.stdout, re.M)
                and re.search(r"^  ps +0=127\.0\.0\.1:\d+  1=127\.0\.0\.1:\d+$", done.stdout, re.M)
                and re.search(r"^wide-deep-ps-1-0 +ps +1 +(pending|running) ", done.stdout, re.M)
            )

        wait_for("`dlrover status wide-deep` to show the cluster", shows_the_cluster, 180)
        hold.unlink()
        assert job.wait(timeout=300) == 0, job.output()[-4000:]
        out, at = job.output(), 0
        for line in PRINTED:
            found = re.compile(line).search(out, at)
            assert found, f"{line!r} not printed after offset {at}:\n{out[-4000:]}"
            at = found.end()
        assert (tmp_path / "wide-deep" / "report.json").is_file()
    finally:
        job.close()
