"""The master API's domain types survive their protobuf form unchanged (dlrover.api.wire)."""

from __future__ import annotations

from dlrover.api import master as api
from dlrover.api import wire


def test_every_message_round_trips_through_its_serialised_form():
    limits = api.NodeLimits(2, 4, 2, 1.5)
    registration = api.Registration("h", 8, "n1", "trainer", 3, 42, limits, "job")
    registered = api.Registered("n1", 7, limits, "job", 2.5)
    heartbeat = api.HeartbeatReport("n1", 7, 12.5, 2**40, 99, "running", 2)
    join = api.JoinRequest("n1", 7, 8, "h0", 29500)
    world = api.CommWorld(
        3,
        True,
        2,
        1,
        16,
        8,
        "h0",
        29500,
    )
    report = api.NodeReport("n1", 7, api.NodeOutcome.FAILED, 3, "rank 2 exit code 3")
    status = api.JobStatus(
        "job",
        "running",
        3,
        "round 3 formed",
        0,
        (api.NodeStatus("a", "running", 0, "h0", 99, 1, 0.25, "trainer", 80.0, 2**33),),
    )

    def again(message, parse):  # through bytes, as the wire carries it
        return parse(type(message).FromString(message.SerializeToString()))

    assert again(wire.registration_to_pb(registration), wire.registration_from_pb) == registration
    assert again(wire.registered_to_pb(registered), wire.registered_from_pb) == registered
    assert again(wire.heartbeat_to_pb(heartbeat), wire.heartbeat_from_pb) == heartbeat
    reply = api.HeartbeatReply(api.HeartbeatAction.STOP, "failed", 20.0)
    assert again(wire.heartbeat_reply_to_pb(reply), wire.heartbeat_reply_from_pb) == reply
    assert again(wire.join_to_pb(join), wire.join_from_pb) == join
    assert again(wire.world_to_pb(world), wire.world_from_pb) == world
    assert again(wire.node_report_to_pb(report), wire.node_report_from_pb) == report
    assert again(wire.job_status_to_pb(status), wire.job_status_from_pb) == status
    first = api.Registration("h", 1)  # no limits: the first node's must fix them
    assert again(wire.registration_to_pb(first), wire.registration_from_pb) == first
