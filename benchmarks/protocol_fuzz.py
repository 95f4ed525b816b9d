"""A protocol fuzzer against every port DLRover listens on: the master's gRPC service, an
embedding server (its gRPC service and its data port), the checkpoint saver's unix socket and
the flash-checkpoint replica port.

    python benchmarks/protocol_fuzz.py --cases 2000 --seed 1

Each target's real server runs in a process of its own (protocol_fuzz_servers.py, port 0).
The fuzzer sends it ``--cases`` seeded cases (protocol_fuzz_cases.py: random bytes, mutated
valid messages, wrong or absent tokens, oversized payloads, truncated streams, unknown enum
values and ops) in batches, several at once, while ``--stalls`` connections per batch open
and then send nothing (slowloris). After each batch a valid request must still be answered
within PROBE_DEADLINE_S. It prints one table: per target, the cases tried and how they were
answered, the slowest valid probe, and the server's threads before, at peak and after.
The invariants (nothing unclear, no crash, no hang, every probe answered, threads back to
where they were) decide the exit status; ``--json`` writes the rows for a test to read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocol_fuzz_cases import ACCEPTED, CLEAR, CRASH, HANG, UNCLEAR  # noqa: E402
from protocol_fuzz_targets import TARGETS, Case, Host, Target  # noqa: E402

PROBE_DEADLINE_S = 5.0
"""A valid request must be answered within this long after every batch of abuse."""
BATCH = 100
"""Cases per batch (then the probe)."""
THREAD_SLACK = 4
"""Threads the server may keep above where it started once the abuse is over (gRPC's and
Python's pools start threads lazily)."""
SETTLE_S = 15.0
"""How long the server's thread count may take to come back after the last batch."""


@dataclass
class Row:
    """One target's results."""

    target: str
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    probe_max_s: float = 0.0
    probe_failures: int = 0
    refused_connections: int = 0
    """Stalled connections the server refused to open (it should queue or serve them)."""
    threads_before: int = 0
    threads_peak: int = 0
    threads_after: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Up to five details of each outcome that breaks an invariant, to reproduce it."""

    def broken(self) -> list[str]:
        """The invariants this row breaks, in words."""
        out = []
        for outcome in (UNCLEAR, HANG, CRASH):
            if self.outcomes.get(outcome):
                out.append(f"{self.target}: {self.outcomes[outcome]} {outcome}")
        if self.refused_connections:
            out.append(f"{self.target}: refused {self.refused_connections} connections")
        if self.probe_failures:
            out.append(f"{self.target}: {self.probe_failures} valid probes unanswered")
        if self.threads_after > self.threads_before + THREAD_SLACK:
            out.append(
                f"{self.target}: threads {self.threads_before} -> {self.threads_after} after"
            )
        return out


# ---------------------------------------------------------------------------- the campaign
@contextlib.contextmanager
def _sampling(host: Host, row: Row) -> Iterator[None]:
    """Track the server's peak thread count while the block runs."""
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            row.threads_peak = max(row.threads_peak, host.threads())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join(5)


def _note(row: Row, outcome: str, kind: str, detail: str) -> None:
    row.outcomes[outcome] = row.outcomes.get(outcome, 0) + 1
    if outcome in (UNCLEAR, HANG, CRASH):
        shown = row.examples.setdefault(outcome, [])
        if len(shown) < 5:
            shown.append(f"{kind}: {detail}")


def fuzz(target_name: str, cases: int, seed: int, concurrency: int, stalls: int) -> Row:
    """Run ``cases`` cases against a fresh server of ``target_name``."""
    row = Row(target_name)
    rng = random.Random(f"{seed}-{target_name}")
    with tempfile.TemporaryDirectory(prefix="dlrover-fuzz-") as folder:
        host = Host(target_name, folder)
        target = TARGETS[target_name](host)
        try:
            outcome, detail = target.probe()
            if outcome != ACCEPTED:
                raise RuntimeError(f"the {target_name} probe fails before any abuse: {detail}")
            with futures.ThreadPoolExecutor(concurrency) as pool:
                # The servers' pools start threads lazily: a burst of valid requests starts
                # them, so that "threads before" is the count of a server at work.
                list(pool.map(lambda _: _safe(target.probe), range(concurrency * 2)))
                target.warm(pool)
                row.threads_before = row.threads_peak = host.threads()
                _run_batches(target, row, pool, rng, cases, stalls)
            if not host.alive():
                _note(row, CRASH, "exit", f"the server exited with {host.proc.returncode}")
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline:
                row.threads_after = host.threads()
                if row.threads_after <= row.threads_before + THREAD_SLACK:
                    break
                time.sleep(0.2)  # a poll of a count that has no event to wait on
        finally:
            target.close()
            host.stop()
    return row


def _run_batches(
    target: Target,
    row: Row,
    pool: futures.Executor,
    rng: random.Random,
    cases: int,
    stalls: int,
) -> None:
    """The cases in batches, several at once, each batch with ``stalls`` stalled connections
    open until the valid probe after it has been answered."""
    host = target.host
    done = 0
    with _sampling(host, row):
        while done < cases and host.alive():
            batch = [target.case(rng) for _ in range(min(BATCH, cases - done))]
            stalled = []
            for _ in range(stalls):
                try:
                    stalled.append(target.stall(rng))
                except OSError as e:
                    row.refused_connections += 1
                    shown = row.examples.setdefault("refused", [])
                    if len(shown) < 5:
                        shown.append(f"a stalled connection: {e}")
            kinds = Counter(kind for kind, _ in batch)
            for kind, n in kinds.items():
                row.kinds[kind] = row.kinds.get(kind, 0) + n
            for (kind, _), result in zip(
                batch, pool.map(_safe, [c for _, c in batch]), strict=True
            ):
                outcome, detail = result
                if outcome != ACCEPTED and not host.alive():
                    outcome = CRASH
                _note(row, outcome, kind, detail)
            done += len(batch)
            started = time.monotonic()
            outcome, detail = _safe(target.probe)
            row.probe_max_s = max(row.probe_max_s, time.monotonic() - started)
            if outcome != ACCEPTED:
                row.probe_failures += 1
                shown = row.examples.setdefault("probe", [])
                if len(shown) < 5:
                    shown.append(f"{outcome}: {detail}")
            for sock in stalled:
                sock.close()
    row.cases = done


def _safe(case: Case) -> tuple[str, str]:
    """A case's outcome; an exception on the fuzzer's side (a refused connection) is judged."""
    try:
        return case()
    except ConnectionRefusedError as e:
        return CRASH, f"connection refused: {e}"
    except TimeoutError as e:
        return HANG, f"timed out: {e}"
    except OSError as e:
        return CLEAR, f"the server closed the connection: {e}"


def table(rows: list[Row]) -> str:
    """The campaign's table (markdown)."""
    lines = [
        "| target | cases | clear errors | accepted | unclear | crashes | hangs | "
        "probe failures | max probe latency | threads before / peak / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        o = r.outcomes
        lines.append(
            f"| {r.target} | {r.cases} | {o.get(CLEAR, 0)} | {o.get(ACCEPTED, 0)} | "
            f"{o.get(UNCLEAR, 0)} | {o.get(CRASH, 0)} | {o.get(HANG, 0)} | {r.probe_failures} | "
            f"{r.probe_max_s * 1000:.0f} ms | {r.threads_before} / {r.threads_peak} / "
            f"{r.threads_after} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated")
    parser.add_argument("--concurrency", type=int, default=8, help="abusers at once")
    parser.add_argument("--stalls", type=int, default=32, help="stalled connections per batch")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name in args.targets.split(","):
        started = time.monotonic()
        row = fuzz(name, args.cases, args.seed, args.concurrency, args.stalls)
        rows.append(row)
        print(f"{name}: {row.cases} cases in {time.monotonic() - started:.1f}s", flush=True)
    print(table(rows))
    broken = [b for r in rows for b in r.broken()]
    for r in rows:
        for outcome, shown in r.examples.items():
            for line in shown:
                print(f"  {r.target} {outcome}: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print("invariants hold" if not broken else "BROKEN: " + "; ".join(broken))
    return 0 if not broken else 1


if __name__ == "__main__":
    sys.exit(main())
