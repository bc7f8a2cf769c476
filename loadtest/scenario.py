"""Run one locust scenario headless, then the verifier: `loadtest/run NAME [options]`.

Writes into the output directory: stats_*.csv (locust's CSV), report.html, locust.log,
client.json (the client record) and verify.txt. Exit status: 0 when locust saw no
failure and the verifier found no breach; 1 otherwise; 3 when the scenario needs an
area the gate does not have yet (payments); 4 when no gate answers at the host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from loadtest.record import ClientRecord

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
SKIPPED = 3
NO_GATE = 4
HEALTH_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Scenario:
    classes: tuple[str, ...]
    users: int
    spawn_rate: float
    run_time: str
    stock: int
    buckets: int
    text: str
    needs: str = ""


SCENARIOS = {
    "flash-sale": Scenario(
        ("FlashSaleBuyer",), 300, 300, "30s", 2000, 8, "a crowd of new buyers sells a deal out"
    ),
    "duplicates": Scenario(
        ("DuplicateClicker",), 100, 100, "30s", 1000, 4, "double clicks and retries, one key"
    ),
    "readers": Scenario(
        ("Reader",), 200, 50, "30s", 0, 1, "buyers polling their order and the deal"
    ),
    "pay": Scenario(
        ("PayingBuyer",),
        50,
        25,
        "30s",
        0,
        4,
        "pay with duplicated and reordered callbacks",
        needs="payments",
    ),
    "late-pay": Scenario(
        ("LatePayer",),
        50,
        25,
        "40s",
        0,
        4,
        "short holds expire while buyers pay late",
        needs="payments and the expiry sweeper",
    ),
    "waiting-room": Scenario(
        ("WaitingRoomBuyer",),
        300,
        100,
        "40s",
        300,
        4,
        "a crowd queues in a waiting room, polls as advised, buys when admitted",
    ),
    "mixed": Scenario(
        ("FlashSaleBuyer", "DuplicateClicker", "Reader", "PayingBuyer", "LatePayer"),
        300,
        100,
        "60s",
        2000,
        8,
        "every scenario at once (payment users stop when payments are missing)",
    ),
    "queue-mode": Scenario(
        ("QueueBuyer",),
        300,
        300,
        "30s",
        2000,
        8,
        "a crowd on a deal in queue mode: 202, then PENDING_PAYMENT within 10 s",
    ),
    "ci": Scenario(
        ("FlashSaleBuyer", "DuplicateClicker", "Reader"),
        30,
        30,
        "5s",
        150,
        4,
        "a few seconds of the crowd, the clickers and the readers (CI)",
    ),
}


def parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:11} {s.text}" for name, s in SCENARIOS.items())
    p = argparse.ArgumentParser(
        prog="loadtest/run",
        description="Run a locust scenario headless against a gate, then verify. Other"
        " arguments are passed to locust (and the locustfile's own options).",
        epilog="scenarios:\n" + lines,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--host", default=os.environ.get("GATE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--users", type=int)
    p.add_argument("--spawn-rate", type=float)
    p.add_argument("--run-time", help="e.g. 30s, 2m")
    p.add_argument("--stock", type=int, help="stock of the flash-sale deal")
    p.add_argument("--buckets", type=int, help="buckets of the flash-sale deal")
    p.add_argument("--out", help="output directory (default loadtest/results/NAME-TIME)")
    p.add_argument(
        "--verify",
        choices=("db", "api", "none"),
        default="db",
        help="db: GATE_MYSQL_URL and GATE_REDIS_URL (default); api: the gate's admin API",
    )
    p.add_argument("--settle-seconds", type=float, default=20.0)
    p.add_argument(
        "--pay-via",
        choices=("direct", "sandbox"),
        default="direct",
        help="pay scenarios: sign callbacks ourselves (direct) or pay on the sandbox's pages",
    )
    p.add_argument("--sandbox-url", default="", help="with --pay-via sandbox: its base URL")
    return p


def gate_problem(host: str) -> str | None:
    """Why the gate at `host` cannot be load-tested, or None when /healthz answers 200."""
    try:
        with urllib.request.urlopen(
            host.rstrip("/") + "/healthz", timeout=HEALTH_TIMEOUT_SECONDS
        ) as answer:
            return None if answer.status == 200 else f"/healthz answered {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"/healthz answered {exc.code}"
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def main(argv: list[str] | None = None) -> int:
    # Arguments this command does not know go to locust (and its locustfile options,
    # e.g. --late-hold-seconds 1 or --loglevel DEBUG).
    args, locust_args = parser().parse_known_args(argv)
    locust_args = [a for a in locust_args if a != "--"]
    sc = SCENARIOS[args.scenario]
    problem = gate_problem(args.host)
    if problem is not None:
        # Otherwise locust runs its whole time against nothing and reports zero requests.
        print(
            f"run: no gate answers at {args.host} ({problem}); start one first"
            " (scripts/run, see loadtest/README.md) or pass --host",
            file=sys.stderr,
        )
        return NO_GATE
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or ROOT / "loadtest" / "results" / f"{args.scenario}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "client.json"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        args.host,
        "-u",
        str(args.users or sc.users),
        "-r",
        str(args.spawn_rate or sc.spawn_rate),
        "-t",
        args.run_time or sc.run_time,
        "--stop-timeout",
        "20",
        "--csv",
        str(out / "stats"),
        "--html",
        str(out / "report.html"),
        "--logfile",
        str(out / "locust.log"),
        "--only-summary",
        "--record",
        str(record_path),
        "--stock",
        str(args.stock or sc.stock or 1000),
        "--buckets",
        str(args.buckets or sc.buckets),
        "--pay-via",
        args.pay_via,
        *(["--sandbox-url", args.sandbox_url] if args.sandbox_url else []),
        *locust_args,
        *sc.classes,
    ]
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    locust_rc = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    if not record_path.exists():
        print(f"run: locust wrote no client record (exit {locust_rc})", file=sys.stderr)
        return 1
    record = ClientRecord.read(record_path)
    for note in record.notes:
        print(f"note: {note}")
    if sc.needs and any("payments unavailable" in n for n in record.notes):
        print(f"run: SKIPPED — the scenario '{args.scenario}' needs {sc.needs}")
        return SKIPPED
    verify_rc = 0
    if args.verify != "none":
        verify = [sys.executable, "-m", "loadtest.verify", "--record", str(record_path)]
        verify += ["--settle-seconds", str(args.settle_seconds)]
        if args.verify == "api":
            verify += ["--api", args.host]
        result = subprocess.run(
            verify, cwd=ROOT, env=env, check=False, capture_output=True, text=True
        )
        (out / "verify.txt").write_text(result.stdout + result.stderr)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        verify_rc = result.returncode
    print(f"results in {out}")
    if locust_rc != 0:
        print(f"run: locust reported failures (exit {locust_rc}); see {out / 'report.html'}")
    return 0 if locust_rc == 0 and verify_rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
