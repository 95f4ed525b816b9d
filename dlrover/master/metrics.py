"""The job's Prometheus metrics, read from the master's state when scraped.

Nothing is counted on the training path: a scrape walks the node table, the goodput tracker, the
failure records and the shard queues, so metrics cost nothing between scrapes. Each master has
its own registry (no process-global one), so several masters in one process (tests, the Ray
master actor) never mix their series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from dlrover.master.goodput import REASONS
from dlrover.master.job import JobMaster
from dlrover.master.nodes import ALIVE_STATES, NodeState
from dlrover.master.roles import RoleNode

_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_RESTART_ACTIONS = ("recover_in_process", "restart_processes", "relaunch_node")


class JobCollector(Collector):
    """Collects one job's metrics (see docs/metrics.md for the list)."""

    def __init__(self, job: JobMaster) -> None:
        self._job = job

    def collect(self) -> Iterator[Metric]:
        """The job's series now."""
        job = self._job
        name = job.config.job_name
        g = job.diagnostics.goodput.snapshot(job.clock())
        yield _gauge(
            "dlrover_goodput_ratio",
            "Productive step time / time since the master started (live estimate)",
            name,
            g.ratio,
        )
        badput = CounterMetricFamily(
            "dlrover_badput_seconds",
            "Time not spent on steps the job keeps, by reason",
            labels=["job_name", "reason"],
        )
        for reason in REASONS:
            badput.add_metric([name, reason], g.badput_s[reason])
        yield badput
        productive = CounterMetricFamily(
            "dlrover_productive_seconds", "Time spent on new steps", labels=["job_name"]
        )
        productive.add_metric([name], g.productive_s)
        yield productive
        steps = CounterMetricFamily(
            "dlrover_job_steps", "The highest training step the job reached", labels=["job_name"]
        )
        steps.add_metric([name], float(g.steps))
        yield steps
        yield _gauge("dlrover_step_seconds", "Seconds per step lately", name, g.step_s)
        recovery = HistogramMetricFamily(
            "dlrover_recovery_seconds",
            "From the last progress before a restart until the job went past that step again",
            labels=["job_name"],
        )
        buckets = [
            (str(b), float(sum(1 for r in g.recoveries_s if r <= b))) for b in _RECOVERY_BUCKETS
        ]
        buckets.append(("+Inf", float(len(g.recoveries_s))))
        recovery.add_metric([name], buckets, sum_value=sum(g.recoveries_s))
        yield recovery

        nodes = job.members.nodes.all()
        by_state = Counter(n.state for n in nodes)
        gauge = GaugeMetricFamily("dlrover_nodes", "Nodes by state", labels=["job_name", "state"])
        for state in NodeState:
            gauge.add_metric([name, state.value], float(by_state.get(state, 0)))
        yield gauge
        cpu = GaugeMetricFamily(
            "dlrover_node_cpu_percent",
            "CPU of a node's agent and workers (100 = one core), from its heartbeats",
            labels=["job_name", "node"],
        )
        mem = GaugeMetricFamily(
            "dlrover_node_memory_bytes",
            "Resident memory of a node's agent and workers, from its heartbeats",
            labels=["job_name", "node"],
        )
        step = GaugeMetricFamily(
            "dlrover_node_step", "The highest step a node reported", labels=["job_name", "node"]
        )
        phases = GaugeMetricFamily(
            "dlrover_node_step_seconds",
            "Seconds per step of a node's slowest worker lately, by phase: data (waiting for "
            "input), checkpoint (blocked in saves), compute (the rest)",
            labels=["job_name", "node", "phase"],
        )
        for n in nodes:
            if n.state in ALIVE_STATES:
                cpu.add_metric([name, n.node_id], n.cpu_percent)
                mem.add_metric([name, n.node_id], float(n.memory_bytes))
                step.add_metric([name, n.node_id], float(n.step))
                wall, data, ckpt = n.breakdown
                if wall > 0:
                    phases.add_metric([name, n.node_id, "data"], data)
                    phases.add_metric([name, n.node_id, "checkpoint"], ckpt)
                    phases.add_metric([name, n.node_id, "compute"], max(0.0, wall - data - ckpt))
        role_nodes = job.roles.role_nodes()
        for r in role_nodes:
            if r.state in ("pending", "running"):
                cpu.add_metric([name, r.node_id], r.cpu_percent)
                mem.add_metric([name, r.node_id], float(r.memory_bytes))
        yield cpu
        yield mem
        yield step
        yield phases
        yield from _role_node_metrics(name, role_nodes)
        rates = job.roles.rates()
        yield _gauge(
            "dlrover_steps_per_second",
            "A TensorFlow job's steps (batches) per second lately, from its chief",
            name,
            rates.steps_per_s,
        )
        yield _gauge(
            "dlrover_samples_per_second",
            "A TensorFlow job's samples per second lately, from its chief",
            name,
            rates.samples_per_s,
        )
        checkpoint = GaugeMetricFamily(
            "dlrover_checkpoint_seconds",
            "Checkpoint time on the slowest node: save (training blocked per step, as scripts "
            "report it) and persist (the latest flash checkpoint's write to storage, in the "
            "background)",
            labels=["job_name", "kind"],
        )
        live = [n for n in nodes if n.state in ALIVE_STATES]
        checkpoint.add_metric([name, "save"], max((n.breakdown[2] for n in live), default=0.0))
        checkpoint.add_metric([name, "persist"], max((n.persist_s for n in live), default=0.0))
        yield checkpoint
        score = GaugeMetricFamily(
            "dlrover_straggler_score",
            "A node's runtime score: the fastest node's step time / its own (1 = fastest)",
            labels=["job_name", "node"],
        )
        for node_id, s in sorted(job.diagnostics.straggler_scores().items()):
            score.add_metric([name, node_id], s.relative)
        yield score

        failures = job.diagnostics.get_failures()  # folded: every failure, counted
        restarts = CounterMetricFamily(
            "dlrover_restarts",
            "Worker restarts in place and node relaunches, by the failure's class",
            labels=["job_name", "reason", "action"],
        )
        counts: Counter[tuple[str, str]] = Counter()
        for f in failures:
            if f.action in _RESTART_ACTIONS:
                counts[(f.failure_class.value, f.action)] += max(1, f.count)
        for (reason, action), count in sorted(counts.items()):
            restarts.add_metric([name, reason, action], float(count))
        yield restarts
        failed = CounterMetricFamily(
            "dlrover_failures",
            "Failures the master recorded, by class",
            labels=["job_name", "reason"],
        )
        by_class: Counter[str] = Counter()
        for f in failures:
            by_class[f.failure_class.value] += max(1, f.count)
        for reason, count in sorted(by_class.items()):
            failed.add_metric([name, reason], float(count))
        yield failed

        shards = GaugeMetricFamily(
            "dlrover_shards_total",
            "Data shards of each dataset: todo, leased (being read) and done",
            labels=["job_name", "dataset", "state"],
        )
        progress = job.sharding.all_progress()
        for p in progress:
            shards.add_metric([name, p.dataset, "todo"], float(p.todo))
            shards.add_metric([name, p.dataset, "leased"], float(p.leased))
            shards.add_metric([name, p.dataset, "done"], float(p.done_shards))
        yield shards
        lag = GaugeMetricFamily(
            "dlrover_stream_lag_records",
            "Records of each stream's partitions available but not yet done",
            labels=["job_name", "stream", "partition"],
        )
        lost = GaugeMetricFamily(
            "dlrover_data_lost",
            "At-most-once data the job's model never trained and that is never handed out "
            "again: samples of a dataset, records of a stream",
            labels=["job_name", "kind", "name"],
        )
        for p in progress:
            lost.add_metric([name, "dataset", p.dataset], float(p.lost_samples))
        for sp in job.sharding.all_stream_progress():
            ends = dict(sp.end_offsets)
            for partition, done in sp.committed:
                lag.add_metric(
                    [name, sp.stream, str(partition)], float(max(0, ends[partition] - done))
                )
            lost.add_metric([name, "stream", sp.stream], float(sp.lost_records))
        yield lag
        yield lost
        yield from _ps_metrics(job)
        yield _gauge(
            "dlrover_rendezvous_round",
            "The latest rendezvous round",
            name,
            float(job.rendezvous.round if job.rendezvous else 0),
        )


def _role_node_metrics(name: str, nodes: list[RoleNode]) -> Iterator[Metric]:
    """The nodes role controllers drive (a TensorFlow job's roles): role and state, relaunches,
    memory limit; their CPU and memory are in the node series above."""
    labels = ["job_name", "node", "role"]
    info = GaugeMetricFamily(
        "dlrover_role_node_state",
        "1 for each node a role controller drives (a TensorFlow job's chief, ps, workers, "
        "evaluator), labelled with its role and state",
        labels=[*labels, "state"],
    )
    relaunches = GaugeMetricFamily(
        "dlrover_role_node_relaunches",
        "Attempts launched after the slot's first, of each role node's slot",
        labels=labels,
    )
    limit = GaugeMetricFamily(
        "dlrover_node_memory_limit_bytes",
        "A role node's memory limit (only nodes that have one)",
        labels=labels,
    )
    for r in nodes:
        info.add_metric([name, r.node_id, r.role, r.state], 1.0)
        relaunches.add_metric([name, r.node_id, r.role], float(r.relaunches))
        if r.memory_limit_bytes:
            limit.add_metric([name, r.node_id, r.role], float(r.memory_limit_bytes))
    yield info
    yield relaunches
    yield limit


def _ps_metrics(job: JobMaster) -> Iterator[Metric]:
    """Each embedding server's rows, memory, lookups and moved rows (a job with a ps role)."""
    servers = job.roles.embedding_servers()
    if servers is None:
        return
    name = job.config.job_name
    labels = ["job_name", "server", "address"]
    series = (
        ("dlrover_ps_rows", "Embedding rows a server holds", "rows"),
        ("dlrover_ps_bytes", "Bytes of a server's rows and optimizer state", "bytes"),
        (
            "dlrover_ps_lookups_per_second",
            "Ids a server looked up per second lately",
            "lookups_per_s",
        ),
        ("dlrover_ps_rows_moved_in", "Rows moved onto a server by resizes", "rows_moved_in"),
        ("dlrover_ps_rows_moved_out", "Rows moved off a server by resizes", "rows_moved_out"),
    )
    stats = servers.stats()
    for metric, doc, field in series:
        g = GaugeMetricFamily(metric, doc, labels=labels)
        for s in stats:
            g.add_metric([name, str(s.index), s.address], float(getattr(s, field)))
        yield g
    failovers = CounterMetricFamily(
        "dlrover_ps_failovers", "Embedding servers replaced from a replica", labels=["job_name"]
    )
    failovers.add_metric([name], float(servers.failovers))
    yield failovers


def _gauge(metric: str, doc: str, job: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(metric, doc, labels=["job_name"])
    g.add_metric([job], value)
    return g


class JobMetrics:
    """A registry holding one job's collector; `render` is the /metrics page."""

    def __init__(self, job: JobMaster) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(job))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series now."""
        return generate_latest(self.registry)
