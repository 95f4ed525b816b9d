"""Job spec: YAML and flags give the same spec; each kind of bad spec gets one clear error."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dlrover.engines.base import Resources
from dlrover.jobspec import (
    JobSpecError,
    job_spec_from_dict,
    job_spec_from_flags,
    load_job_spec,
    parse_memory_mib,
)

GOOD_YAML = """
name: mnist
entrypoint: train.py
args: [--epochs, "3"]
nodes: "2:4"
nproc_per_node: 2
resources: {cpu: 4, memory: 8Gi, gpu: 1, shm: 2Gi}
max_restarts: 3
checkpoint_dir: /ckpt/mnist
engine: kubernetes
engine_settings: {namespace: train, image: dlrover:latest}
"""


def test_yaml_spec_loads_and_matches_flags(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(GOOD_YAML)
    spec = load_job_spec(path)
    assert (spec.name, spec.entrypoint, spec.args) == ("mnist", "train.py", ("--epochs", "3"))
    assert (spec.min_nodes, spec.max_nodes, spec.nproc_per_node) == (2, 4, 2)
    assert spec.resources == Resources(cpu=4, memory_mib=8192, gpu=1, shm_mib=2048)
    assert spec.engine_settings == {"namespace": "train", "image": "dlrover:latest"}
    flags = job_spec_from_flags(
        "train.py",
        ["--epochs", "3"],
        nnodes="2:4",
        nproc_per_node=2,
        engine="kubernetes",
        name="mnist",
        cpu=4,
        memory="8Gi",
        gpu=1,
        max_restarts=3,
        checkpoint_dir="/ckpt/mnist",
        engine_settings={"namespace": "train", "image": "dlrover:latest"},
    )
    assert flags.resources == Resources(cpu=4, memory_mib=8192, gpu=1)
    assert flags == dataclasses.replace(spec, resources=flags.resources)
    assert (
        flags.agent_command()
        == spec.agent_command()
        == (
            "dlrover-run",
            "--nnodes=2:4",
            "--rdzv-id=mnist",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "train.py",
            "--epochs",
            "3",
        )
    )


def test_hang_timeout_reaches_every_agent() -> None:
    """A job's workers hung for that long restart: without it a hung worker of a submitted job
    held the job until someone stopped it (found by benchmarks/fault_campaign.py)."""
    spec = job_spec_from_dict({"entrypoint": "train.py", "hang_timeout": 30})
    assert spec.hang_timeout_s == 30
    assert spec.agent_command()[-2:] == ("--hang-timeout=30", "train.py")
    flags = job_spec_from_flags("train.py", hang_timeout=7.5)
    assert "--hang-timeout=7.5" in flags.agent_command()
    assert not any("hang" in arg for arg in job_spec_from_flags("train.py").agent_command())


def test_hang_detection_is_on_by_default_and_set_per_phase_in_the_spec() -> None:
    """``hang_timeout`` takes what ``--hang-timeout`` takes: auto (the default, nothing passed),
    off, or per phase as a string or a mapping; every agent gets it."""
    assert job_spec_from_dict({"entrypoint": "train.py"}).hang_timeout == "auto"
    spec = job_spec_from_dict(
        {"entrypoint": "train.py", "hang_timeout": {"step": 120, "eval": "off", "min": 10}}
    )
    assert "--hang-timeout=eval=off,step=120,min=10" in spec.agent_command()
    off = job_spec_from_dict({"entrypoint": "train.py", "hang_timeout": "off"})
    assert "--hang-timeout=off" in off.agent_command()
    flags = job_spec_from_flags("train.py", hang_timeout="step=90")
    assert "--hang-timeout=step=90" in flags.agent_command()
    with pytest.raises(JobSpecError, match="hang_timeout is 'step=soon'.*not a number"):
        job_spec_from_dict({"entrypoint": "train.py", "hang_timeout": "step=soon"})


def test_a_shared_compile_cache_and_spares_reach_the_job() -> None:
    spec = job_spec_from_dict({"entrypoint": "train.py", "compile_cache": "/nfs/cc", "spares": 2})
    assert spec.spares == 2
    assert spec.agent_command()[-2:] == ("--compile-cache=/nfs/cc", "train.py")
    flags = job_spec_from_flags("train.py", compile_cache="/nfs/cc", spares=1)
    assert "--compile-cache=/nfs/cc" in flags.agent_command() and flags.spares == 1


def test_the_delivery_mode_reaches_every_worker_s_environment() -> None:
    spec = job_spec_from_dict({"entrypoint": "train.py", "delivery_mode": "at-most-once"})
    node = spec.node_spec(rank=0, master_addr="10.0.0.1:5000", token="t")
    assert node.env["DLROVER_DELIVERY_MODE"] == "at-most-once"
    plain = job_spec_from_flags("train.py")  # no mode named: each reader's own default
    assert "DLROVER_DELIVERY_MODE" not in plain.node_spec(0, "m:1", "t").env
    assert job_spec_from_flags("train.py", delivery_mode="exactly-once").delivery_mode == (
        "exactly-once"
    )
    with pytest.raises(JobSpecError, match="delivery_mode is 'twice'; it must be one of"):
        job_spec_from_dict({"entrypoint": "train.py", "delivery_mode": "twice"})


def test_node_spec_carries_master_address_and_token() -> None:
    spec = job_spec_from_flags("train.py", nnodes="1:2", name="job-b", memory=1024)
    node = spec.node_spec(rank=1, master_addr="10.0.0.1:5000", token="s3cret", relaunch_count=2)
    assert node.node_id == "job-b-worker-1-2"
    assert node.env["DLROVER_MASTER_ADDR"] == "10.0.0.1:5000"
    assert node.env["DLROVER_JOB_TOKEN"] == "s3cret"
    assert node.resources.memory_mib == 1024
    assert node.command[-1] == "train.py"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"engine": "slurm"}, "unknown engine 'slurm'; choose one of local, ray, kubernetes"),
        ({"nodes": "4:2"}, "MIN \\(4\\) is greater than MAX \\(2\\)"),
        ({"resources": {"cpu": -1}}, "resources.cpu is -1; it must be >= 0"),
        ({"resources": {"memory": "-2Gi"}}, "resources.memory is -2Gi; it must be >= 0"),
        ({"resources": {"gpu": -1}}, "resources.gpu is -1; it must be >= 0"),
        ({"entrypoint": None}, "entrypoint is missing"),
        ({"entrypoint": ""}, "entrypoint is missing"),
        ({"nodes": "two"}, "must be N or MIN:MAX"),
        ({"nproc_per_node": 0}, "nproc_per_node is 0"),
        ({"resources": {"memory": "lots"}}, "'lots' is not a size"),
        ({"epochs": 3}, "unknown keys \\['epochs'\\]"),
        ({"hang_timeout": -1}, "hang_timeout is -1; it must be seconds >= 0"),
        ({"spares": -1}, "spares is -1; it must be an integer >= 0"),
        ({"spares": 1, "auto_scale": True}, "spares are hot spare nodes .* not with auto_scale"),
    ],
)
def test_bad_spec_gets_one_clear_error(change: dict[str, object], message: str) -> None:
    raw: dict[str, object] = {"entrypoint": "train.py", "nodes": "1:2"}
    raw.update(change)
    with pytest.raises(JobSpecError, match=message) as info:
        job_spec_from_dict(raw)
    assert "\n" not in str(info.value)  # one message, not a dump


def test_missing_entrypoint_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("nodes: 2\n")
    with pytest.raises(JobSpecError, match=f"{path}: entrypoint is missing"):
        load_job_spec(path)


def test_unreadable_and_invalid_yaml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="cannot read job spec"):
        load_job_spec(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("entrypoint: [unclosed\n")
    with pytest.raises(JobSpecError, match="is not valid YAML"):
        load_job_spec(bad)


def test_memory_sizes() -> None:
    assert parse_memory_mib("4Gi") == 4096
    assert parse_memory_mib("512Mi") == 512
    assert parse_memory_mib(2048) == 2048
    assert parse_memory_mib("1G") == 954


def test_oom_growth_is_configurable_and_checked() -> None:
    from dlrover.jobspec import JobSpecError, job_spec_from_dict

    spec = job_spec_from_dict(
        {"entrypoint": "t.py", "oom_memory_factor": 2, "oom_max_memory": "8Gi"}
    )
    assert (spec.oom_memory_factor, spec.oom_max_memory_mib) == (2.0, 8192)
    default = job_spec_from_dict({"entrypoint": "t.py"})
    assert (default.oom_memory_factor, default.oom_max_memory_mib) == (1.5, 256 * 1024)
    with pytest.raises(JobSpecError, match="oom_memory_factor is 1; it must be a number > 1"):
        job_spec_from_dict({"entrypoint": "t.py", "oom_memory_factor": 1})


@pytest.mark.parametrize(
    "entrypoint,args,program",
    [
        # The original DLRover's ElasticJob: the whole command as one string.
        (
            "python -m model_zoo.iris --steps 300",
            [],
            ("--module", "model_zoo.iris", "--steps", "300"),
        ),
        (
            "python3 train.py --epochs 2",
            ["--lr", "0.1"],
            ("train.py", "--epochs", "2", "--lr", "0.1"),
        ),
        ("train.py 'a b'", [], ("train.py", "a b")),
        ("train.py", ["--x"], ("train.py", "--x")),
        ("/bin/run-it --fast", [], ("/bin/run-it", "--fast")),
    ],
)
def test_a_command_given_as_one_string_is_split_as_a_shell_would(
    entrypoint: str, args: list[str], program: tuple[str, ...]
) -> None:
    spec = job_spec_from_dict({"name": "j", "entrypoint": entrypoint, "args": args})
    assert spec.program() == program
    assert spec.agent_command()[-len(program) :] == program


def test_a_command_that_cannot_be_split_is_one_clear_error() -> None:
    with pytest.raises(JobSpecError, match="cannot be split as a shell would"):
        job_spec_from_dict({"name": "j", "entrypoint": "python 'train.py"})
