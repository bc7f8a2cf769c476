"""One entry point for the load tests and benchmarks:

    python -m loadtest                      the list below
    python -m loadtest NAME [ARGS...]       run one; `python -m loadtest NAME --help`

Each name runs the `main` of its module with ARGS, as `python -m loadtest.MODULE ARGS`
does; the shell wrappers (loadtest/run, loadtest/bench) come here too. The experiments
(loadtest/experiments/) are listed last.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it runs)
COMMANDS: dict[str, tuple[str, str]] = {
    "scenario": ("loadtest.scenario", "one locust scenario headless, then the verifier"),
    "verify": ("loadtest.verify", "the post-run verifier of a client record"),
    "bench": ("loadtest.benchmark", "the benchmark runner: the gate against the baseline"),
    "bench-callbacks": ("loadtest.bench_callbacks", "the payment callback benchmark"),
    "bench-cluster": (
        "loadtest.bench_cluster",
        "the gate on Redis Cluster against one Redis",
    ),
    "bench-expiry": ("loadtest.bench_expiry", "expiry release throughput"),
    "bench-partitions": ("loadtest.bench_partitions", "one hot deal in 1 against 3 partitions"),
    "bench-queue": ("loadtest.bench_queue", "the queue mode benchmark"),
    "bench-room": ("loadtest.bench_room", "the waiting room's benchmark"),
    "bench-webhooks": (
        "loadtest.bench_webhooks",
        "events delivered to a local receiver during a sale; the sale with and without",
    ),
    "bench-challenge": (
        "loadtest.bench_challenge",
        "the room's proof of work: client cost by demand, verification's share",
    ),
    "hotpath": ("loadtest.hotpath", "CPU per request of the hot paths, in process"),
    "ab-tracing": (
        "loadtest.ab_tracing",
        "traces on at 1 % against off, sold-out and commit, pair by pair",
    ),
    "room-sim": (
        "loadtest.room_sim",
        "a waiting-room sale simulated in process: the chance and the auto rate",
    ),
    "baseline": ("loadtest.baseline.__main__", "the DB-only peer baseline (serve, migrate, check)"),
    # Experiments (loadtest/experiments/): one-off measurements, kept to repeat them.
    "bench-console": (
        "loadtest.experiments.console_bench",
        "the sale with and without the live console",
    ),
    "ab-queued": (
        "loadtest.experiments.ab_queued",
        "queue mode's 202 at the edge, measured pair by pair",
    ),
    "ab-ticket": (
        "loadtest.experiments.ab_ticket",
        "a room ticket by callback or by task, pair by pair",
    ),
    "reserve-probe": (
        "loadtest.experiments.reserve_probe",
        "the reservation procedures alone",
    ),
    "room-memory": (
        "loadtest.experiments.room_memory",
        "bytes per waiting-room ticket on a real Redis",
    ),
    "shard-sim": ("loadtest.experiments.shard_sim", "sharding by deal, simulated and checked"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: python -m loadtest NAME [ARGS...]", ""]
    for name, (module, what) in COMMANDS.items():
        if module.startswith("loadtest.experiments.") and "experiments:" not in lines:
            lines += ["", "experiments:"]
        lines.append(f"  {name:<{width}}  {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"python -m loadtest: unknown name {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    # The module's own parser reads sys.argv, as when it is run by itself.
    sys.argv = [f"python -m loadtest {name}", *rest]
    code = module.main()
    return int(code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
