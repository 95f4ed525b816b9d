"""What `dlrover status` prints: a running job's table from its master, an ended job's final
table, scale plans and failures from the records it left."""

from __future__ import annotations

import time

from dlrover.api.master import FailureClass, FailureRecord, JobStatus, NodeStatus
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.collectives import behind, laggards, merge
from dlrover.coordination import TF_CLUSTER, TF_PS_GENERATION
from dlrover.decisions import NO_ACTION
from dlrover.runner.records import FinalState, JobRecord, read_final, read_record

NODE_HEADERS = {"ray": "ray actor", "kubernetes": "pod"}
"""The first column's header by engine: what the node's id names there (else ``node``)."""
ROLE_ORDER = {"chief": -2, "ps": -1, "worker": 0, "evaluator": 1}
"""The order of a parameter-server job's roles in the table (any other role: with workers); a
table with any of them but ``worker`` gets a role column (agents' roles, ``default`` or
``worker``, get none)."""


def status_table(status: JobStatus, master_host: str = "", engine: str = "") -> str:
    """The job's state line and node table: each node's id (the Ray actor's or pod's name on
    those engines), rank, state, progress, usage and process ids (the agent's and its workers'
    by local rank, on the node's host)."""
    lines = [
        f"job {status.job_name}: {status.state} (round {status.round}, goodput "
        f"{status.goodput:.1%})" + (f" - {status.reason}" if status.reason else "")
    ]
    if status.metrics_port and not status.ended:
        lines.append(f"dashboard: http://{master_host or 'MASTER'}:{status.metrics_port}/")
    if status.node_check:
        lines.append(status.node_check)
    if status.autoscale:
        lines.append(status.autoscale)
    if status.data_lost:
        lines.append(status.data_lost)
    if status.samples_per_s:
        lines.append(
            f"throughput: {status.samples_per_s:.0f} samples/s, {status.steps_per_s:.1f} steps/s"
        )
    # Embedding servers (a ps role in a job without a TensorFlow chief) get a section of their
    # own below: the node table keeps the agents' columns.
    servers = {}
    if not any(n.role == "chief" for n in status.nodes):
        servers = {n.node_rank: n for n in status.nodes if n.role == "ps"}
    nodes = [n for n in status.nodes if not (servers and n.role == "ps")]
    check = any(n.check for n in nodes)
    score = any(n.score for n in nodes)
    timed = any(n.step_wall_s for n in nodes)
    # A parameter-server job's nodes have roles and (its controller's) memory limits.
    roles = any(n.role in ROLE_ORDER and n.role != "worker" for n in nodes)
    limits = any(n.memory_limit_bytes for n in nodes)
    header = NODE_HEADERS.get(engine, "node")
    lines.append(
        f"{header:<28} "
        + (f"{'role':<9} " if roles else "")
        + f"{'rank':>4} {'state':<10} {'step':>8} {'restarts':>8} {'cpu%':>6} {'mem MB':>8} "
        + (f"{'limit MB':>8} " if limits else "")
        + f"{'pid':>8} {'worker pids':<16}"
        + (f" {'s/step':>7} {'data':>6} {'ckpt':>6}" if timed else "")
        + (f" {'score':>6}" if score else "")
        + ("  check" if check else "")
    )
    for n in sorted(nodes, key=lambda n: (ROLE_ORDER.get(n.role, 0), n.node_rank, n.node_id)):
        workers = ",".join(str(p) for p in n.worker_pids) or "-"
        limit = f"{n.memory_limit_bytes / 2**20:>8.0f}" if n.memory_limit_bytes else f"{'-':>8}"
        lines.append(
            f"{n.node_id:<28} "
            + (f"{n.role:<9} " if roles else "")
            + f"{n.node_rank:>4} {n.state:<10} {n.step:>8} "
            f"{n.restart_count:>8} {n.cpu_percent:>6.0f} {n.memory_bytes / 2**20:>8.0f} "
            + (f"{limit} " if limits else "")
            + f"{n.pid or '-':>8} {workers:<16}"
            + (
                f" {n.step_wall_s:>7.3f} {n.step_data_s:>6.3f} {n.step_checkpoint_s:>6.3f}"
                if timed
                else ""
            )
            + (f" {n.score:>6.2f}" if score else "")
            + (f"  {n.check}" if check else "")
        )
    if status.embedding_servers or servers:
        lines.extend(_server_lines(status, servers))
    return "\n".join(lines)


def _server_lines(status: JobStatus, servers: dict[int, NodeStatus]) -> list[str]:
    """The embedding servers' section: each server's rows and lookups (a running job's), and
    its node: id, state, restarts, CPU and memory."""
    lines = [
        f"{'embedding server':<28} {'address':<22} {'rows':>10} {'MB':>8} {'ids/s':>9}  "
        f"{'node':<24} {'state':<10} {'restarts':>8} {'cpu%':>6} {'mem MB':>8}"
    ]
    live = {e.index: e for e in status.embedding_servers}
    for index in sorted(set(live) | set(servers)):
        e, n = live.get(index), servers.get(index)
        lines.append(
            f"{'ps ' + str(index):<28} "
            + (
                f"{e.address:<22} {e.rows:>10} {e.bytes / 2**20:>8.1f} {e.lookups_per_s:>9.0f}"
                if e is not None
                else f"{'-':<22} {'-':>10} {'-':>8} {'-':>9}"
            )
            + (
                f"  {n.node_id:<24} {n.state:<10} {n.restart_count:>8} {n.cpu_percent:>6.0f} "
                f"{n.memory_bytes / 2**20:>8.0f}"
                if n is not None
                else ""
            )
        )
    return lines


def failure_lines(failures: tuple[FailureRecord, ...], full: bool = False) -> list[str]:
    """The failures as `dlrover diagnose` lists them: a header, then one line each, ending with
    the round the failure led to and what it cost (the job back past its last step that long
    after its last progress before the failure; ``full``: with the whole root cause indented
    under it). A folded record (one failure from many nodes, numbers aside) is one line: the
    time of the first, the newest one's node ``+`` the number of other nodes, its cause, and
    how many failures it stands for."""
    lines = [f"{'time':<8}  {'node':<28} {'class':<12} {'action':<17} root cause"]
    for f in failures:
        cause = f.root_cause.strip() or "-"
        first = cause.splitlines()[0]
        stamp = time.strftime("%H:%M:%S", time.localtime(f.first_at or f.at))
        cost = f", back {f.cost_s:.1f}s after" if f.cost_s else ""
        then = f"  (-> round {f.round}{cost})" if f.round else ""
        node = f.node_id
        if f.count > 1:
            last = time.strftime("%H:%M:%S", time.localtime(f.at))
            node = f"{f.node_id}+{max(0, f.node_count - 1)}"  # the newest's and the others
            then += f"  [x{f.count} from {f.node_count} nodes until {last}]"
        lines.append(
            f"{stamp:<8}  {node:<28} {f.failure_class.value:<12} {f.action:<17} {first}{then}"
        )
        if full and cause != first:
            lines.append("    " + cause.replace("\n", "\n    "))
    return lines


def hang_lines(failures: tuple[FailureRecord, ...]) -> list[str]:
    """What the hangs' collectives say (`dlrover.collectives`), per round a hang led to: which
    rank the others wait for, in which collective, and that rank's stack."""
    lines: list[str] = []
    rounds = sorted(
        {
            f.round
            for f in failures
            if f.failure_class is FailureClass.HANG and f.action != NO_ACTION
        }
    )
    for round in rounds:
        hung = [f for f in failures if f.failure_class is FailureClass.HANG and f.round == round]
        ranks = merge([f.collectives for f in hung])
        if not ranks:
            continue
        lines.append(f"hang{f' (-> round {round})' if round else ''}:")
        lines.extend(f"  {line}" for line in laggards(ranks))
        for rank in behind(ranks):
            stack = str(ranks[rank].get("stack", "")).strip()
            if stack:
                lines.append(f"  rank {rank}'s stack:")
                lines.extend(f"    {line}" for line in stack.splitlines())
    return lines


_RECOVERY_WORDS = (
    ("recover_in_process", "in-process (survivors kept their processes)"),
    ("restart_processes", "restart in place"),
    ("relaunch_node", "node relaunch"),
)


def recovery_line(failures: tuple[FailureRecord, ...]) -> str:
    """How the job's failures were recovered, counted by kind ("" without failures), e.g.
    ``recoveries: 2 in-process (survivors kept their processes), 1 restart in place``."""
    counts = [
        (sum(max(1, f.count) for f in failures if f.action == action), words)
        for action, words in _RECOVERY_WORDS
    ]
    parts = [f"{n} {words}" for n, words in counts if n]
    return f"recoveries: {', '.join(parts)} (dlrover diagnose lists each)" if parts else ""


def plan_lines(name: str) -> list[str]:
    """The auto-scaler's plans as `dlrover diagnose` lists them: an ended job's every plan
    acted on, a running job's latest plan; [] for none (or a master that does not answer)."""
    record = read_record(name)
    if not record.reachable:
        final = read_final(name)
        plans = final.plans if final is not None else ()
        return (
            [f"plans ({len(plans)}):"]
            + [f"  {time.strftime('%H:%M:%S', time.localtime(at))}  {text}" for at, text in plans]
            if plans
            else []
        )
    client = MasterClient(record.master_addr, record.token, rpc_timeout_s=5)
    try:
        latest = client.get_job_status(with_nodes=False).autoscale
    except MasterClientError:
        return []
    finally:
        client.close()
    return [f"latest plan: {latest}"] if latest else []


def final_text(record: JobRecord, final: FinalState | None) -> str:
    """An ended job's status: its outcome, then (when it left them) its last node table, the
    scale plans acted on and its failures."""
    head = f"job {record.name}: {record.state}" + (f" - {record.reason}" if record.reason else "")
    if final is None:
        return head  # it ended before serving, or an older DLRover ran it
    lines = [head, status_table(final.status, engine=record.engine).split("\n", 1)[1]]
    lines.append(f"plans ({len(final.plans)}):" if final.plans else "plans: none")
    for at, text in final.plans:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(at))}  {text}")
    if final.failures:
        lines.append(f"failures ({len(final.failures)}):")
        lines.extend("  " + line for line in failure_lines(final.failures))
    else:
        lines.append("failures: none")
    return "\n".join(lines)


def status_text(name: str) -> tuple[str, bool]:
    """The job's status as ``dlrover status`` prints it, and whether the job has ended (then the
    text is its final state). Raises MasterClientError if its master does not answer."""
    record = read_record(name)
    if not record.reachable:
        return final_text(record, read_final(name)), True
    client = MasterClient(record.master_addr, record.token, rpc_timeout_s=5)
    try:
        host = record.master_addr.rsplit(":", 1)[0]
        text = status_table(client.get_job_status(), host, record.engine)
        recovered = recovery_line(client.get_failures())
        return text + (f"\n{recovered}" if recovered else "") + tf_cluster_text(client), False
    finally:
        client.close()


def tf_cluster_text(client: MasterClient) -> str:
    """A TensorFlow job's cluster spec and ps generation, from the master's KV ("" otherwise)."""
    cluster = TF_CLUSTER.get(client)
    if cluster is None:
        return ""
    generation = TF_PS_GENERATION.get(client)
    ps = f", ps generation {generation.generation}" if generation else ""
    lines = [f"\ntensorflow cluster version {cluster.version}{ps}:"]
    for role, addresses in cluster.cluster.items():
        lines.append(f"  {role:<8} " + "  ".join(f"{i}={a}" for i, a in enumerate(addresses)))
    return "\n".join(lines)
