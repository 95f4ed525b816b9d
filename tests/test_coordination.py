"""The typed KV records of TensorFlow and embedding-server jobs keep the JSON the keys had."""

from __future__ import annotations

import json

import pytest

from dlrover import constants as c
from dlrover.coordination import PsGeneration, ScaleReport, TfCluster
from dlrover.json_messages import MessageError


def test_records_store_the_json_the_keys_always_had() -> None:
    cluster = TfCluster(3, {"chief": ["h:1"], "ps": ["h:2", "h:3"]})
    assert json.loads(cluster.encode()) == {
        "version": 3,
        "cluster": {"chief": ["h:1"], "ps": ["h:2", "h:3"]},
    }
    assert TfCluster.decode(cluster.encode()) == cluster
    generation = PsGeneration(2, 3)
    assert json.loads(generation.encode()) == {"generation": 2, "cluster_version": 3}
    assert PsGeneration.decode(generation.encode()) == generation
    assert PsGeneration.of(None) == 0 and PsGeneration.of(generation.encode()) == 2


def test_a_scale_report_stores_only_the_fields_of_its_action() -> None:
    report = ScaleReport("scale", 2, request=4, tf=True, seconds=1.5)
    assert json.loads(report.encode()) == {
        "action": "scale",
        "servers": 2,
        "request": 4,
        "tf": True,
        "seconds": 1.5,
    }
    assert ScaleReport.decode(report.encode()) == report
    # What a master before these types wrote reads back.
    old = b'{"action": "replace", "index": 1, "node": "ps-1-1", "restored_rows": 7, "servers": 2}'
    assert ScaleReport.decode(old) == ScaleReport(
        "replace", 2, index=1, node="ps-1-1", restored_rows=7
    )


def test_a_malformed_record_names_the_bad_field() -> None:
    with pytest.raises(MessageError, match="generation"):
        PsGeneration.decode(b'{"generation": "two", "cluster_version": 1}')
    with pytest.raises(MessageError, match="not JSON"):
        TfCluster.decode(b"{")


class _Kv:
    """A master's key-value store as the CLI reads it (kv_get only)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        return self.values.get(key)


def test_dlrover_status_and_the_tf_node_read_the_records() -> None:
    from dlrover.cli.status_view import tf_cluster_text
    from dlrover.cli.tf_node import _published
    from dlrover.constants import TF_CLUSTER_KEY, TF_PS_GENERATION_KEY

    cluster = TfCluster(3, {"chief": ["h:1"], "ps": ["h:2", "h:3"]})
    kv = _Kv({TF_CLUSTER_KEY: cluster.encode(), TF_PS_GENERATION_KEY: PsGeneration(2, 3).encode()})
    assert tf_cluster_text(kv) == (  # type: ignore[arg-type]
        "\ntensorflow cluster version 3, ps generation 2:\n  chief    0=h:1\n  ps       0=h:2  1=h:3"
    )
    del kv.values[TF_PS_GENERATION_KEY]  # no ps serves yet
    assert tf_cluster_text(kv).startswith("\ntensorflow cluster version 3:\n")  # type: ignore[arg-type]
    assert tf_cluster_text(_Kv({})) == ""  # type: ignore[arg-type]  # not a TensorFlow job
    assert _published(cluster.encode()) == (3, {"chief": ["h:1"], "ps": ["h:2", "h:3"]})
    assert _published(None) == (0, {})
    with pytest.raises(MessageError):
        _published(b'{"version": "three", "cluster": {}}')


def test_a_channel_keeps_the_keys_its_ends_used_before_and_reads_back_its_record() -> None:
    from dlrover.coordination import PS_SCALE, TF_ADDRESS, TF_CLUSTER
    from dlrover.master.kv_store import KvStore
    from dlrover.master.state_store import MemoryStateStore

    kv = KvStore(MemoryStateStore())
    spec = TfCluster(2, {"chief": ["h:1"]})
    TF_CLUSTER.put(kv, spec, version=2)
    # The stored values under the keys a node of an earlier release reads.
    assert kv.get(c.TF_CLUSTER_KEY) == kv.get(f"{c.TF_CLUSTER_KEY}/2") == spec.encode()
    assert TF_CLUSTER.get(kv) == spec and TF_CLUSTER.get(kv, version=3) is None
    TF_ADDRESS.put(kv, "h:5", "job-ps-0-1")
    assert kv.get(c.TF_ADDRESS_KEY + "job-ps-0-1") == b"h:5"
    assert TF_ADDRESS.get(kv, "job-ps-0-1") == "h:5"
    with pytest.raises(ValueError, match="a node id is expected"):
        TF_ADDRESS.get(kv)
    with pytest.raises(ValueError, match="keeps no versions"):
        PS_SCALE.get(kv, version=1)
    kv.set(c.PS_SCALE_KEY, b'{"action": 3}')
    with pytest.raises(MessageError):
        PS_SCALE.get(kv)
