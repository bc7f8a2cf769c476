"""The live sale console's server side, over real HTTP against a real
gate process: off unless enabled, sessions, CSRF, the shared snapshot, the actions
through the admin API's functions with the operator's session in the ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gate.base.metrics import sample_values, value_of
from gate.console.session import SessionSigner
from gate.store.db import Database
from tests.console_support import (
    ConsoleSession,
    console_env,
    fresh_address,
    session_cookie,
    sign_in,
)
from tests.support import (
    ADMIN,
    ADMIN_TOKEN,
    Client,
    GateCommand,
    GateProcess,
    Resp,
    assert_invariants,
    create_deal,
    db_available,
    reserve,
)


@pytest.fixture(scope="module")
def console_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """One worker, so that every request of a test meets the same snapshot cache."""
    with GateProcess(console_env(env), workers=1) as proc:
        yield proc


@pytest.fixture
async def cc(console_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(console_gate.url) as c:
        yield c


@pytest.fixture
async def op(cc: Client) -> ConsoleSession:
    r, session = await sign_in(cc)
    assert r.status_code == 200 and session is not None, r.text
    return session


async def ledger_rows(db: Database, deal_id: int) -> list[tuple[str, str, str | None]]:
    rows = await db.fetchall(
        "SELECT reason, actor, note FROM inventory_ledger WHERE deal_id = %s ORDER BY id",
        (deal_id,),
    )
    return [(str(r[0]), str(r[1]), r[2]) for r in rows]


async def test_console_is_off_unless_enabled(client: Client) -> None:
    # The shared gate runs with GATE_ENV=test and no GATE_CONSOLE: no route at all.
    for path in ("/console", "/console/api/snapshot", "/console/static/console.js"):
        r = await client.get(path)
        assert r.status_code == 404 and r.headers["Content-Type"] == "application/problem+json"
    r = await client.post("/console/api/session", json={"token": ADMIN_TOKEN})
    assert r.status_code == 404


async def test_page_is_packaged_and_self_contained(cc: Client) -> None:
    page = await cc.get("/console")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    # Offline: every script and stylesheet comes from the gate itself.
    assert "http://" not in page.text and "https://" not in page.text.replace(
        "http://www.w3.org", ""
    )
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
        r = await cc.get(f"/console/static/{name}")
        assert r.status_code == 200 and r.headers["Content-Type"].startswith(kind)
    r = await cc.get("/console/static/..%2Fsession.py")
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"


async def test_sign_in_cookie_and_wrong_token(cc: Client) -> None:
    r, session = await sign_in(cc, "wrong-token-000000000000")
    assert r.status_code == 401 and session is None and r.json()["code"] == "UNAUTHORIZED"
    for bad in (b"{}", b'{"token": 5}', b'{"token": "x", "more": 1}', b"not json"):
        r = await cc.post(
            "/console/api/session", content=bad, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, (bad, r.text)
        assert r.headers["Content-Type"] == "application/problem+json"
    r, session = await sign_in(cc)
    assert r.status_code == 200 and session is not None
    raw = next(v for v in r.headers.getall("Set-Cookie") if v.startswith("gate_console="))
    attrs = {a.strip().split("=")[0].lower() for a in raw.split(";")[1:]}
    assert {"httponly", "max-age", "path", "samesite"} <= attrs
    assert "samesite=strict" in raw.lower() and "max-age=1800" in raw.lower()
    assert "secure" not in attrs  # plain http here; https gets Secure (docs/console.md)
    assert ADMIN_TOKEN not in raw  # the cookie is not the token
    who = await cc.get("/console/api/session", headers=session.read())
    assert who.status_code == 200 and who.json()["csrf_token"] == session.csrf
    assert who.json()["actor"].startswith("console:")


async def test_no_admin_data_without_a_valid_session(cc: Client, op: ConsoleSession) -> None:
    deal_id = await create_deal(cc, stock=5)
    signer = SessionSigner(ADMIN_TOKEN, ADMIN_TOKEN, 1800)
    _, expired = signer.issue(now=time.time() - 3600)
    _, foreign = SessionSigner("another-secret-0123456789abcdef0123", ADMIN_TOKEN, 1800).issue()
    valid = op.cookie.split("=", 1)[1]
    tampered = valid[:-2] + ("AA" if not valid.endswith("AA") else "BB")
    for cookie in (None, "", expired, foreign, tampered, "x" * 300, "a.b.c", "%%%.%%%"):
        headers = {} if cookie is None else {"Cookie": f"gate_console={cookie}"}
        for path in (
            "/console/api/snapshot",
            "/console/api/session",
            f"/console/api/deals/{deal_id}/ledger",
            f"/console/api/deals/{deal_id}/advice",
        ):
            r = await cc.get(path, headers=headers)
            assert r.status_code == 401, (cookie, path, r.text)
            assert r.headers["Content-Type"] == "application/problem+json"
    # A session made outside the process with the same derived key is accepted: any
    # worker can verify a cookie, nothing is stored.
    _, minted = signer.issue()
    r = await cc.get("/console/api/snapshot", headers={"Cookie": f"gate_console={minted}"})
    assert r.status_code == 200


async def test_state_changes_need_the_csrf_token(
    cc: Client, op: ConsoleSession, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(cc, stock=40, buckets=2)
    before = await ledger_rows(db, deal_id)
    flipped = op.csrf[:-1] + ("A" if op.csrf[-1] != "A" else "B")
    wrong = {"Cookie": op.cookie, "X-CSRF-Token": flipped}
    for headers in (op.read(), wrong):
        for action, body in (("buckets", {"count": 4}), ("stock", {"delta": 5, "reason": "x"})):
            r = await cc.post(f"/console/api/deals/{deal_id}/{action}", json=body, headers=headers)
            assert r.status_code == 403 and r.json()["code"] == "FORBIDDEN", r.text
        r = await cc.request("DELETE", "/console/api/session", headers=headers)
        assert r.status_code == 403
    # Nothing changed: same layout, same stock, no ledger row, still signed in.
    assert await db_available(db, deal_id) == {0: 20, 1: 20}
    assert await ledger_rows(db, deal_id) == before
    assert (await cc.get("/console/api/snapshot", headers=op.read())).status_code == 200
    # Another session's token does not fit this session.
    _, other = await sign_in(cc)
    assert other is not None and other.csrf != op.csrf
    r = await cc.post(
        f"/console/api/deals/{deal_id}/buckets",
        json={"count": 4},
        headers={"Cookie": op.cookie, "X-CSRF-Token": other.csrf},
    )
    assert r.status_code == 403
    await assert_invariants(db, rds, deal_id)


async def test_actions_go_through_the_admin_functions_and_name_the_session(
    cc: Client, op: ConsoleSession, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(cc, stock=90, buckets=3)
    assert (await reserve(cc, deal_id, 7001, "console-act-0001")).status_code == 201
    actor = (await cc.get("/console/api/session", headers=op.read())).json()["actor"]
    base = f"/console/api/deals/{deal_id}"

    r = await cc.post(base + "/buckets", json={"count": 5}, headers=op.write())
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["bucket_count"] == 5 and view["invariant"]["ok"]
    assert len(await db_available(db, deal_id)) == 5
    rows = await ledger_rows(db, deal_id)
    assert any(
        reason == "rebucket" and a == actor and note == "buckets 3 -> 5" for reason, a, note in rows
    )

    r = await cc.post(base + "/stock", json={"delta": 10, "reason": "restock"}, headers=op.write())
    assert r.status_code == 200 and r.json()["totals"]["total"] == 100
    r = await cc.post(base + "/stock", json={"delta": -4, "reason": "damaged"}, headers=op.write())
    assert r.status_code == 200 and r.json()["totals"]["available"] == 89 + 10 - 4
    rows = await ledger_rows(db, deal_id)
    assert {(reason, note) for reason, a, note in rows if a == actor and reason == "adjust"} == {
        ("adjust", "restock"),
        ("adjust", "damaged"),
    }

    # The sale window: through Deals.set_window, as PUT /v1/admin/deals/{id}/window.
    r = await cc.post(
        base + "/window",
        json={"starts_at": "2099-01-01T00:00:00Z", "ends_at": None},
        headers=op.write(),
    )
    assert r.status_code == 200 and r.json()["starts_at"] == "2099-01-01T00:00:00.000000Z"
    refused = await reserve(cc, deal_id, 7002, "console-act-0002")
    assert refused.status_code == 409 and refused.json()["code"] == "NOT_ACTIVE"
    r = await cc.put(
        f"/v1/admin/deals/{deal_id}/window",
        json={"starts_at": None, "ends_at": None},
        headers=ADMIN,
    )
    assert r.status_code == 200 and r.json()["starts_at"] is None
    assert (await reserve(cc, deal_id, 7002, "console-act-0003")).status_code == 201

    # Bad input: a clear 4xx, nothing changed.
    layout = await db_available(db, deal_id)
    ledger = await ledger_rows(db, deal_id)
    for action, body, status in (
        ("buckets", {"count": 0}, 400),
        ("buckets", {"count": "3"}, 400),
        ("stock", {"delta": 0, "reason": "x"}, 400),
        ("stock", {"delta": -10_000, "reason": "too many"}, 409),
        ("window", {"starts_at": "2099-01-02T00:00:00Z", "ends_at": "2099-01-01T00:00:00Z"}, 400),
        ("window", {"starts_at": "yesterday", "ends_at": None}, 400),
        ("window", {"starts_at": None}, 400),
        ("room", {"admission_rate": 5}, 404),  # no such action
    ):
        r = await cc.post(f"{base}/{action}", json=body, headers=op.write())
        assert r.status_code == status, (action, body, r.text)
        assert r.headers["Content-Type"] == "application/problem+json"
    r = await cc.post("/console/api/deals/999999999/buckets", json={"count": 2}, headers=op.write())
    assert r.status_code == 404
    assert await db_available(db, deal_id) == layout
    assert await ledger_rows(db, deal_id) == ledger

    # The console's ledger view, newest first, and the bucket advice.
    r = await cc.get(base + "/ledger", headers=op.read())
    items = r.json()["items"]
    assert r.status_code == 200 and items[0]["id"] > items[-1]["id"]
    assert items[0]["reason"] == "reserve"
    advice = (await cc.get(base + "/advice", headers=op.read())).json()
    assert advice["source"] == "docs/buckets.md" and 1 <= advice["suggested"] <= 4
    await assert_invariants(db, rds, deal_id)


async def test_sign_out_ends_the_session_everywhere(cc: Client, db: Database) -> None:
    r, session = await sign_in(cc)
    assert session is not None
    r = await cc.request("DELETE", "/console/api/session", headers=session.write())
    assert r.status_code == 200
    cleared = session_cookie(r)
    assert cleared is not None and cleared in ('gate_console=""', "gate_console=")
    # The old cookie, replayed, is refused by every process (revoked in Redis).
    r = await cc.get("/console/api/snapshot", headers=session.read())
    assert r.status_code == 401


async def test_snapshot_is_computed_once_a_second_for_all_open_pages(
    cc: Client, op: ConsoleSession, db: Database
) -> None:
    deal_id = await create_deal(cc, stock=30, buckets=3)
    assert (await reserve(cc, deal_id, 7101, "console-snap-0001")).status_code == 201

    async def page() -> str:
        r = await cc.get("/console/api/snapshot", headers=op.read())
        assert r.status_code == 200, r.text
        return str(r.json()["generated_at"])

    # Twenty pages asking at once, three rounds: each round is served from at most
    # two computations (one if it does not straddle a refresh).
    seen: set[str] = set()
    for _ in range(3):
        stamps = await asyncio.gather(*(page() for _ in range(20)))
        assert len(set(stamps)) <= 2, stamps
        seen |= set(stamps)
        await asyncio.sleep(1.05)
    assert 3 <= len(seen) <= 6
    snap = (await cc.get("/console/api/snapshot", headers=op.read())).json()
    deal = next(d for d in snap["deals"] if d["id"] == deal_id)
    assert (deal["total"], deal["available"], deal["held"], deal["sold"]) == (30, 29, 1, 0)
    assert deal["total"] == deal["available"] + deal["held"] + deal["sold"]
    assert sorted(b["available"] for b in deal["bucket_rows"]) == sorted(
        (await db_available(db, deal_id)).values()
    )
    assert all(b["redis_available"] == b["available"] for b in deal["bucket_rows"])
    # A sync deal without a room: no panel of queue mode or of the waiting room.
    assert deal["status"] == "live" and "queue" not in deal and "waiting_room" not in deal
    rates = snap["gate"]["reservations_per_second"]
    assert set(rates) == {"created", "sold_out", "rate_limited", "unavailable"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GATE_CONSOLE", "maybe"),
        ("GATE_CONSOLE_SESSION_SECONDS", "5"),
        ("GATE_CONSOLE_SESSION_SECONDS", "half an hour"),
        ("GATE_CONSOLE_SECRET", "short"),
        ("GATE_CONSOLE_SECURE_COOKIE", "sometimes"),
    ],
)
def test_bad_console_settings_stop_start_up(env: dict[str, str], name: str, value: str) -> None:
    proc = GateCommand(console_env(env, **{name: value}), "serve", "--port", "1")
    try:
        proc.proc.wait(30)
    finally:
        code = proc.stop()
    assert code == 2 and name in proc.output(), proc.output()


async def test_cookie_is_secure_over_https(env: dict[str, str]) -> None:
    """Sign-in needs no lifespan (its limiter's Redis client connects on first use),
    so the app answers it in process: one ASGI request with the https scheme (what
    uvicorn sets when it terminates TLS itself)."""
    from gate.api.app import build_app
    from gate.base.settings import load_settings

    app = build_app(load_settings(console_env(env)))
    body = b'{"token": "' + ADMIN_TOKEN.encode() + b'"}'
    sent: list[dict[str, object]] = []
    for scheme in ("https", "http"):
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": scheme,
            "path": "/console/api/session",
            "raw_path": b"/console/api/session",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"gate.example"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 443),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive(messages: list[dict[str, object]] = messages) -> dict[str, object]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        await app(scope, receive, send)  # type: ignore[arg-type]
    # Sign-in's limiter used the gate's Redis client; no lifespan closes it here.
    await app.state.gate.redis.aclose()
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [200, 200]
    cookies = [
        b"".join(v for k, v in m["headers"] if k == b"set-cookie").lower()  # type: ignore[attr-defined]
        for m in starts
    ]
    assert b"; secure" in cookies[0] and b"httponly" in cookies[0]
    assert b"; secure" not in cookies[1]


def _cookie_attributes(r: Resp) -> set[str]:
    raw = next(v for v in r.headers.getall("Set-Cookie") if v.startswith("gate_console="))
    return {a.strip().split("=")[0].lower() for a in raw.split(";")[1:]}


async def _signed_in_attributes(client: Client, proto: str | None) -> set[str]:
    headers = {} if proto is None else {"X-Forwarded-Proto": proto}
    r, session = await sign_in(client, headers=headers)
    assert r.status_code == 200 and session is not None, r.text
    return _cookie_attributes(r)


async def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(
    env: dict[str, str], prepared: None
) -> None:
    """X-Forwarded-Proto decides the scheme only when the peer is a trusted proxy;
    GATE_CONSOLE_SECURE_COOKIE=always makes every cookie Secure."""
    trusting = GateProcess(console_env(env), workers=1)
    untrusting = GateProcess(console_env(env, GATE_TRUSTED_PROXIES="192.0.2.1"), workers=1)
    always = GateProcess(console_env(env, GATE_CONSOLE_SECURE_COOKIE="always"), workers=1)
    clients: list[Client] = []
    try:
        for proc in (trusting, untrusting, always):
            proc.wait_ready()
        ct, cu, ca = (Client(p.url) for p in (trusting, untrusting, always))
        clients.extend((ct, cu, ca))
        assert "secure" in await _signed_in_attributes(ct, "https")
        # The last value is the one the trusted peer added.
        assert "secure" in await _signed_in_attributes(ct, "http, https")
        assert "secure" not in await _signed_in_attributes(ct, "https, http")
        assert "secure" not in await _signed_in_attributes(ct, "http")
        assert "secure" not in await _signed_in_attributes(ct, None)
        assert "secure" not in await _signed_in_attributes(ct, "gopher")
        # 127.0.0.1 is not a trusted proxy here: its X-Forwarded-Proto is ignored.
        assert "secure" not in await _signed_in_attributes(cu, "https")
        assert "secure" in await _signed_in_attributes(ca, None)
        assert "secure" in await _signed_in_attributes(ca, "http")
        # Sign-out's expiring cookie carries the same attribute.
        _, session = await sign_in(ct, headers={"X-Forwarded-Proto": "https"})
        assert session is not None
        out = await ct.request(
            "DELETE",
            "/console/api/session",
            headers={**session.write(), "X-Forwarded-Proto": "https"},
        )
        assert out.status_code == 200 and "secure" in _cookie_attributes(out)
    finally:
        for c in clients:
            await c.close()
        for proc in (trusting, untrusting, always):
            proc.stop()


async def test_rotating_the_admin_token_ends_sessions_with_a_console_secret(
    env: dict[str, str], prepared: None
) -> None:
    """GATE_CONSOLE_SECRET stays, GATE_ADMIN_TOKEN changes: a cookie signed before
    is refused. The same two settings again accept it (a restart keeps sessions)."""
    secret = "console-secret-0123456789abcdef0123456789"
    rotated = "rotated-admin-token-0123456789abcdef0123"
    before = GateProcess(console_env(env, GATE_CONSOLE_SECRET=secret), workers=1)
    again = GateProcess(console_env(env, GATE_CONSOLE_SECRET=secret), workers=1)
    after = GateProcess(
        console_env(env, GATE_CONSOLE_SECRET=secret, GATE_ADMIN_TOKEN=rotated), workers=1
    )
    clients: list[Client] = []
    try:
        for proc in (before, again, after):
            proc.wait_ready()
        cb, cg, ca = (Client(p.url) for p in (before, again, after))
        clients.extend((cb, cg, ca))
        r, session = await sign_in(cb)
        assert r.status_code == 200 and session is not None, r.text
        assert (await cb.get("/console/api/snapshot", headers=session.read())).status_code == 200
        assert (await cg.get("/console/api/snapshot", headers=session.read())).status_code == 200
        refused = await ca.get("/console/api/snapshot", headers=session.read())
        assert refused.status_code == 401, refused.text
        assert refused.json()["code"] == "UNAUTHORIZED"
        # The rotated gate takes its own token, not the old one.
        r, _ = await sign_in(ca)
        assert r.status_code == 401
        r, fresh = await sign_in(ca, rotated)
        assert r.status_code == 200 and fresh is not None
        assert (await cb.get("/console/api/snapshot", headers=fresh.read())).status_code == 401
    finally:
        for c in clients:
            await c.close()
        for proc in (before, again, after):
            proc.stop()


async def test_sign_in_attempts_are_limited_per_address_and_failures_counted(
    console_gate: GateProcess, cc: Client
) -> None:
    """Ten attempts a minute per client address (the address X-Forwarded-For names,
    127.0.0.1 being a trusted proxy here): the eleventh is 429 with Retry-After even
    with the right token, another address still signs in. Wrong tokens are counted
    in gate_console_signin_failures_total, not logged one by one."""

    async def failures(reason: str) -> float:
        samples = sample_values(await cc.metrics())
        return value_of(samples, "gate_console_signin_failures_total", reason=reason)

    wrong_before = await failures("wrong_token")
    limited_before = await failures("rate_limited")
    log_before = console_gate.output()
    guesser = fresh_address()
    for i in range(10):
        r, _ = await sign_in(cc, f"guess-{i:04d}-000000000000", address=guesser)
        assert r.status_code == 401, r.text
    for token in ("guess-again-000000000000", ADMIN_TOKEN):
        r, session = await sign_in(cc, token, address=guesser)
        assert r.status_code == 429 and session is None, r.text
        assert r.headers["Content-Type"] == "application/problem+json"
        assert r.json()["code"] == "RATE_LIMITED"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
    r, session = await sign_in(cc, address=fresh_address())
    assert r.status_code == 200 and session is not None
    # A malformed attempt counts against its address too.
    other = fresh_address()
    for _ in range(10):
        bad = await cc.post(
            "/console/api/session",
            content=b"not json",
            headers={"Content-Type": "application/json", "X-Forwarded-For": other},
        )
        assert bad.status_code == 400
    r, _ = await sign_in(cc, address=other)
    assert r.status_code == 429

    async def counted() -> bool:
        return (
            await failures("wrong_token") - wrong_before == 10
            and await failures("rate_limited") - limited_before == 3
        )

    for _ in range(50):
        if await counted():
            break
        await asyncio.sleep(0.1)
    assert await failures("wrong_token") - wrong_before == 10
    assert await failures("rate_limited") - limited_before == 3
    logged = console_gate.output()[len(log_before) :]
    assert "sign-in" not in logged and "refused" not in logged, logged
