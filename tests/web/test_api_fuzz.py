"""The HTTP API fuzzed from its own `/openapi.json` with schemathesis, as a buyer and as
an operator, against a real gate with the sandbox payment provider: whatever is sent,
no answer is a 5xx (bad input is a 4xx problem), a 405 names the allowed methods, and
the API conforms to its document: schema-valid requests are accepted, schema-invalid
ones refused, and every answer matches its response schema (tests/web/schemathesis.toml
holds the one exception, with its reason).

The seed is fixed so that a failure in CI can be replayed; schemathesis prints the
curl command of every failing case."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tests.payments_support as ps
from gate.store.keys import admin_attempts
from tests.support import ADMIN_TOKEN, base_env, redis_client, token

pay_stack = ps.pay_stack

SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))
CONFIG = Path(__file__).with_name("schemathesis.toml")
EXAMPLES_MAX = 40
SEED = 20261201
RUN_SECONDS_MAX = 300


@pytest.mark.slow
@pytest.mark.parametrize("who", ["buyer", "operator"])
def test_no_generated_request_gets_a_server_error(
    pay_stack: ps.PayStack, who: str, tmp_path: Path
) -> None:
    bearer = token(7_800_001) if who == "buyer" else ADMIN_TOKEN
    result = subprocess.run(
        [
            SCHEMATHESIS,
            "--config-file",
            str(CONFIG),
            "run",
            pay_stack.gate.url + "/openapi.json",
            "--header",
            f"Authorization: Bearer {bearer}",
            "--checks",
            "not_a_server_error,unsupported_method,positive_data_acceptance,"
            "negative_data_rejection,response_schema_conformance",
            "--max-examples",
            str(EXAMPLES_MAX),
            "--seed",
            str(SEED),
            "--generation-database",
            "none",
            # Generous: creating a deal of 1,024 buckets on a shared, loaded 2-core
            # machine took over 10 s (a timeout is an error, not a finding).
            "--request-timeout",
            "30",
            # One worker: CPython 3.11's ast.parse is not safe across threads, and
            # hypothesis parses lambdas (a "recursion depth mismatch" SystemError).
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS_MAX,
        check=False,
    )
    # The buyer's token sent to the admin operations counts as wrong admin tokens from
    # loopback: the guard's window (gate/web/admin_guard.py) would refuse the next
    # minute's admin calls of every later test. What this test caused, it clears.
    asyncio.run(_forget_admin_attempts())
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts, out[-3000:]
    # Every operation of the schema was reached, with a real number of cases.
    # 14 of the contract, 7 of the waiting room, 3 of its buyer page, PUT …/window,
    # PUT …/mode, 9 of the webhook endpoints, POST …/pause and …/resume.
    assert re.search(r"Tested: 37\b", out), out[-3000:]
    assert int(counts.group(1)) == int(counts.group(2)) >= 200, out[-3000:]


async def _forget_admin_attempts() -> None:
    rds = redis_client(base_env()["GATE_REDIS_URL"])
    try:
        await rds.delete(admin_attempts("127.0.0.1"))
    finally:
        await rds.aclose()
