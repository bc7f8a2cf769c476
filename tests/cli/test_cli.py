"""The gate command: check, token, and start-up refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jwt
import redis.asyncio as aioredis

from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import (
    CLUSTER_RUN,
    GATE_BIN,
    JWT_SECRET,
    STANDALONE_REDIS_URL,
    Client,
    create_deal,
    reserve,
    settled_report,
)


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


async def test_check_reports_and_exits_by_verdict(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=6, buckets=2)
    assert (await reserve(client, deal_id, 810_001, "cli-check-001")).status_code == 201
    await settled_report(db, rds, deal_id)
    ok = run(env, "check", "--deal", str(deal_id))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"deal {deal_id}: OK  total=6 available=5 held=1 sold=0" in ok.stdout
    as_json = run(env, "check", "--deal", str(deal_id), "--json")
    assert as_json.returncode == 0
    report = json.loads(as_json.stdout)
    assert report["ok"] is True and report["deals"][0]["redis"]["compared"] is True

    # A ledger row that no counter reflects is a breach.
    await db.execute(
        "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held, d_sold,"
        " available_before, available_after, reason, actor) VALUES (%s, 0, 1, 1, 0, 0, 0, 1,"
        " 'forged', 'test')",
        (deal_id,),
    )
    try:
        bad = run(env, "check", "--deal", str(deal_id))
        assert bad.returncode == 1
        assert "BREACH" in bad.stdout and "ledger sums" in bad.stdout
    finally:
        await db.execute("DELETE FROM inventory_ledger WHERE reason = 'forged'")

    # Redis disagreeing with the database while nothing is in flight is a breach too.
    # The shared gates repair drift within a second, so the drift is seeded in a
    # Redis database none of them uses, and `gate check` is pointed at it (on a
    # cluster run, a logical database of the standalone Redis: a cluster has only 0).
    base_url = STANDALONE_REDIS_URL if CLUSTER_RUN else env["GATE_REDIS_URL"]
    alt_url = base_url.rsplit("/", 1)[0] + "/10"
    alt = aioredis.Redis.from_url(alt_url, decode_responses=True)
    try:
        await alt.flushdb()
        keys = deal_keys(deal_id)
        await alt.hset(keys.meta, mapping={"nb": 2, "avail": 7})
        await alt.hset(keys.buckets, mapping={"0": 5, "1": 2})
        drift = run({**env, "GATE_REDIS_URL": alt_url}, "check", "--deal", str(deal_id), "--json")
        assert drift.returncode == 1, drift.stdout
        breaches = json.loads(drift.stdout)["deals"][0]["invariant"]["breaches"]
        # The hold came from a random start bucket, so bucket 0 holds 2 or 3 in the DB.
        assert any(
            b in breaches
            for b in ("redis: bucket 0 has 5, database 2", "redis: bucket 0 has 5, database 3")
        ), breaches
        assert "redis: total 7, database 5" in breaches, breaches
    finally:
        await alt.flushdb()
        await alt.aclose()


def test_token_mints_a_verifiable_buyer_token(env: dict[str, str]) -> None:
    out = run(env, "token", "4242")
    assert out.returncode == 0
    claims = jwt.decode(out.stdout.strip(), JWT_SECRET, algorithms=["HS256"])
    assert claims["sub"] == "4242" and claims["exp"] > claims["iat"]
    assert JWT_SECRET not in out.stdout + out.stderr


def test_out_of_range_arguments_are_usage_errors(env: dict[str, str]) -> None:
    """Each command bounds its numbers as the HTTP API bounds the same values: a usage
    error (exit 2, no traceback) instead of a server on port 34463 (`--port 99999`),
    a traceback (`demo --stock -5`) or an "invariant breach" for a deal id no deal
    can have (`check --deal 2**64`)."""
    for args, message in (
        (("serve", "--port", "99999"), "--port: must be within 1..65535, got 99999"),
        (("serve", "--workers", "0"), "--workers: must be within 1..64, got 0"),
        (("demo", "--stock", "-5"), "--stock: must be within 0..1000000000, got -5"),
        (("demo", "--buckets", "0"), "--buckets: must be within 1..1024, got 0"),
        (("check", "--deal", str(2**64)), "--deal: must be within 1..9223372036854775807"),
        (("token", "0"), "user_id: must be within 1..9223372036854775807, got 0"),
        (("token", "7", "--ttl-seconds", "-5"), "--ttl-seconds: must be within 1..31622400"),
        (
            ("queue", "status", "--deal", str(2**63)),
            "--deal: must be within 1..9223372036854775807",
        ),
        (("queue", "retry", "x"), "entry_id: must be an integer, got 'x'"),
    ):
        out = run(env, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr, (args, out.stderr)


def test_a_reader_that_went_away_is_not_a_traceback(env: dict[str, str]) -> None:
    """`gate token 7 | head -c 10`: the reader closes the pipe before the command
    writes (here: before it starts); the command ends quietly, exit 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [GATE_BIN, "token", "7"],
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_start_up_refuses_bad_configuration(env: dict[str, str], tmp_path: object) -> None:
    production = {k: v for k, v in env.items() if k != "GATE_JWT_SECRET"}
    production["GATE_ENV"] = "production"
    out = run(production, "serve", "--port", "1")
    assert out.returncode == 2
    assert "GATE_JWT_SECRET is required" in out.stderr

    out = run({**env, "GATE_DB_POOL_MAX": "banana"}, "serve", "--port", "1")
    assert out.returncode == 2 and "GATE_DB_POOL_MAX must be an integer" in out.stderr

    out = run({**env, "GATE_WEBHOOK_SECRET": "not-a-whsec"}, "serve", "--port", "1")
    assert out.returncode == 2 and "whsec_" in out.stderr

    for name, value, message in (
        ("GATE_LIMIT_USER", "banana", "GATE_LIMIT_USER must be '<count>/<s|m|h>'"),
        ("GATE_LIMIT_GLOBAL", "10/d", "GATE_LIMIT_GLOBAL must be"),
        ("GATE_LIMIT_IP", "0/s", "count and burst must be between 1"),
        ("GATE_TRUSTED_PROXIES", "10.0.0.0/8 nonsense", "'nonsense' is not an IP address"),
        ("GATE_REDIS_DOWN_POLICY", "maybe", "GATE_REDIS_DOWN_POLICY must be"),
        ("GATE_LOG_LEVEL", "verbose", "GATE_LOG_LEVEL must be one of"),
        ("GATE_BODY_TIMEOUT_SECONDS", "0", "GATE_BODY_TIMEOUT_SECONDS must be within"),
        ("GATE_HTTP_CONCURRENCY_MAX", "none", "GATE_HTTP_CONCURRENCY_MAX must be an integer"),
        ("GATE_LIMIT_IP_V6_PREFIX", "16", "GATE_LIMIT_IP_V6_PREFIX must be within 32..128"),
        ("GATE_LEASE_SECONDS", "0.1", "GATE_LEASE_SECONDS must be within 0.3..60"),
        ("GATE_LEASE_SECONDS", "soon", "GATE_LEASE_SECONDS must be a number"),
        ("GATE_MYSQL_URL", "mysql://root@127.0.0.1:99999/gate", "GATE_MYSQL_URL has a port"),
        ("GATE_REDIS_URL", "redis://127.0.0.1:http/0", "GATE_REDIS_URL has a port"),
        # The areas' settings are checked before any worker starts (not inside each
        # worker, with a traceback, restarted over and over).
        ("GATE_SWEEP_BATCH_MAX", "banana", "GATE_SWEEP_BATCH_MAX must be an integer"),
        ("GATE_PAYMENT_PROVIDER_URL", "ftp://x", "GATE_PAYMENT_PROVIDER_URL must be"),
        ("GATE_WEBHOOK_SECRET", "whsec_not*base64", "GATE_WEBHOOK_SECRET"),
        # Queue mode (gate/queuemode/service.py).
        ("GATE_QUEUE_ATTEMPTS_MAX", "0", "GATE_QUEUE_ATTEMPTS_MAX must be within 1..100"),
        ("GATE_QUEUE_CLAIM_IDLE_SECONDS", "1", "GATE_QUEUE_CLAIM_IDLE_SECONDS must exceed"),
        ("GATE_QUEUE_MODE_REFRESH_SECONDS", "5", "GATE_QUEUE_MODE_REFRESH_SECONDS must be"),
    ):
        for args in (("serve", "--port", "1", "--workers", "2"), ("check",)):
            out = run({**env, name: value}, *args)
            assert out.returncode == 2, (name, args, out.stderr)
            assert message in out.stderr, (name, args, out.stderr)
            assert "Traceback" not in out.stderr, (name, args, out.stderr)

    lua = tmp_path / "lua"  # type: ignore[operator]
    lua.mkdir()
    out = run({**env, "GATE_LUA_DIR": str(lua)}, "serve", "--port", "1")
    assert out.returncode == 2 and "missing; refusing to start" in out.stderr
    # No secret ever reaches the output.
    assert env["GATE_ADMIN_TOKEN"] not in out.stdout + out.stderr


REQUIRED = ("GATE_JWT_SECRET", "GATE_ADMIN_TOKEN", "GATE_ADMISSION_SECRET", "GATE_WEBHOOK_SECRET")


def test_a_command_without_its_settings_names_every_one_to_set(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A shell with none of the gate's settings (GATE_ENV unset: production): the
    command names every required secret at once, and how to give them; in a checkout
    where scripts/run wrote .local/dev.env, it says to source that."""
    bare = {k: v for k, v in env.items() if not k.startswith("GATE_")}
    out = subprocess.run(
        [GATE_BIN, "token", "42"], env=bare, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert f"{', '.join(REQUIRED)} are required: set each" in out.stderr, out.stderr
    assert "GATE_ENV=dev" in out.stderr and "Traceback" not in out.stderr
    assert "dev.env" not in out.stderr
    (tmp_path / ".local").mkdir()
    (tmp_path / ".local" / "dev.env").write_text("export GATE_ENV=dev\n")
    out = subprocess.run(
        [GATE_BIN, "check"], env=bare, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert "`source .local/dev.env`" in out.stderr, out.stderr
    # Said for a shell that did not choose production, not for one that did.
    out = subprocess.run(
        [GATE_BIN, "check"],
        env={**bare, "GATE_ENV": "production"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "dev.env" not in out.stderr, out.stderr


async def test_commands_print_no_log_lines(client: Client, env: dict[str, str]) -> None:
    """At GATE_LOG_LEVEL=INFO (the default), a command's stdout is its output alone
    and its stderr holds no JSON log lines: `gate deal list` once printed the
    database writer's JSON line into its table (a terminal shows both streams)."""
    deal_id = await create_deal(client, stock=3)
    info = {**env, "GATE_LOG_LEVEL": "INFO"}
    for args, first in (
        (("deal", "list", "--after", str(deal_id - 1), "--limit", "1"), f"deal {deal_id}: "),
        (("deal", "show", str(deal_id)), ""),
        (("check", "--deal", str(deal_id)), f"deal {deal_id}: OK"),
        (("token", "42"), "eyJ"),
    ):
        out = run(info, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout.startswith(first), (args, out.stdout)
        for line in (out.stdout + out.stderr).splitlines():
            assert not line.lstrip().startswith('{"ts"'), (args, line)
            assert '"level":' not in line, (args, line)
        assert out.stderr == "" or out.stderr.startswith("gate: "), (args, out.stderr)
