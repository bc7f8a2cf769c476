"""Buyer tokens signed by the shop's identity provider (gate/web/jwks.py).

A real `gate serve` reads its keys from a JWKS the test serves on loopback (plain
http, so GATE_ENV=dev) and refreshes it every second: RS256, ES256 and EdDSA tokens
reserve; a key added to the served set works without a restart; a removed key's
tokens (even one verified and cached before) stop working; wrong issuer, audience
or algorithm, alg none and an expired token are 401 problem+json and change
nothing. The file variant runs a second gate without GATE_JWT_SECRET. The rest
(bounds, the unknown-kid refresh schedule, https outside dev) run in process.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gate.base.settings import SettingsError, load_settings
from gate.store.db import Database
from gate.web.jwks import (
    JWKS_KEYS_MAX,
    JWKS_MAX_BYTES,
    UNKNOWN_KID_REFRESH_SECONDS,
    JwksError,
    JwksKeys,
    parse_jwks,
)
from tests.support import GATE_BIN, Client, GateProcess, base_env, create_deal, free_port, token

ISSUER = "https://id.shop.example/"
AUDIENCE = "gate-buyers"
# How long a change of the served set may take to reach the gate (refresh: 1 s).
PICKUP_SECONDS = 20.0
USER_BASE = 7_940_000  # a range no other test file uses (orders are counted per buyer)

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
ED_KEY = ed25519.Ed25519PrivateKey.generate()
EC_NEXT = ec.generate_private_key(ec.SECP256R1())


def jwk(private: Any, kid: str, alg: str | None = None) -> dict[str, Any]:
    """The public JWK of a private key (its alg left to derivation unless given)."""
    public = private.public_key()
    if isinstance(private, rsa.RSAPrivateKey):
        data = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(private, ec.EllipticCurvePrivateKey):
        data = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        data = OKPAlgorithm.to_jwk(public, as_dict=True)
    data["kid"] = kid
    if alg:
        data["alg"] = alg
    return data


def signed(
    private: Any, alg: str, kid: str, user: int, ttl_seconds: int = 600, **claims: Any
) -> str:
    now = int(time.time())
    payload = {"sub": str(user), "iat": now, "exp": now + ttl_seconds, "iss": ISSUER}
    payload["aud"] = AUDIENCE
    payload.update(claims)
    payload = {name: value for name, value in payload.items() if value is not None}
    return jwt.encode(payload, private, algorithm=alg, headers={"kid": kid})


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_by_hand(claims: dict[str, Any], key: bytes, kid: str) -> str:
    """HS256 keyed with any bytes (PyJWT refuses to sign with a public key's PEM)."""
    head = b64url(orjson.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}))
    body = b64url(orjson.dumps(claims))
    mac = hmac.digest(key, f"{head}.{body}".encode(), "sha256")
    return f"{head}.{body}.{b64url(mac)}"


BASE_KEYS = [jwk(RSA_KEY, "rsa-1"), jwk(EC_KEY, "ec-1"), jwk(ED_KEY, "ed-1")]


class JwksServer:
    """A JWKS on http://127.0.0.1:<free port>/jwks.json whose keys the test changes."""

    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = list(BASE_KEYS)
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                if self.path != "/jwks.json":
                    self.send_error(404)
                    return
                body = orjson.dumps({"keys": outer.keys})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/jwks.json"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def idp_env(**extra: str) -> dict[str, str]:
    env = base_env()
    env.update(
        {
            "GATE_ENV": "dev",
            "GATE_JWT_JWKS_REFRESH_SECONDS": "1",
            "GATE_JWT_ISSUER": ISSUER,
            "GATE_JWT_AUDIENCE": AUDIENCE,
            **extra,
        }
    )
    return env


@pytest.fixture(scope="module")
def jwks_server() -> Iterator[JwksServer]:
    server = JwksServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def idp_gate(prepared: None, jwks_server: JwksServer) -> Iterator[GateProcess]:
    # GATE_JWT_SECRET stays set (base_env): HS256 and the provider's tokens together.
    with GateProcess(idp_env(GATE_JWT_JWKS_URL=jwks_server.url), workers=1) as proc:
        yield proc


@pytest.fixture
async def idp_client(idp_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(idp_gate.url) as client:
        yield client


_keys_used = iter(range(1_000_000))


async def reserve_with(client: Client, deal: int, bearer_token: str) -> Any:
    headers = {
        "Authorization": f"Bearer {bearer_token}",
        "Idempotency-Key": f"jwks-{next(_keys_used):08d}",
    }
    return await client.post(
        f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=headers
    )


async def orders_of(db: Database, user: int) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE user_id = %s", (user,))
    assert row is not None
    return int(row[0])


async def until_accepted(client: Client, bearer_token: str, accepted: bool) -> None:
    """Wait until the gate accepts (or refuses) the token: a read of an order that
    does not exist is 404 to a buyer it knows, 401 otherwise, and changes nothing."""
    deadline = time.monotonic() + PICKUP_SECONDS
    headers = {"Authorization": f"Bearer {bearer_token}"}
    while True:
        r = await client.get("/v1/orders/01ARZ3NDEKTSV4RRFFQ69G5FAV", headers=headers)
        assert r.status_code in (401, 404), r.text
        if (r.status_code == 404) == accepted:
            return
        assert time.monotonic() < deadline, f"not {'accepted' if accepted else 'refused'}"
        await asyncio.sleep(0.3)


def assert_401(r: Any) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["Content-Type"] == "application/problem+json"
    assert r.json()["code"] == "UNAUTHORIZED"


async def test_rs256_es256_eddsa_and_hs256_tokens_reserve(idp_client: Client, db: Database) -> None:
    deal = await create_deal(idp_client, stock=50)
    for n, (private, alg, kid) in enumerate(
        [(RSA_KEY, "RS256", "rsa-1"), (EC_KEY, "ES256", "ec-1"), (ED_KEY, "EdDSA", "ed-1")]
    ):
        user = USER_BASE + n
        r = await reserve_with(idp_client, deal, signed(private, alg, kid, user))
        assert r.status_code == 201, (alg, r.text)
        assert await orders_of(db, user) == 1
    # GATE_JWT_SECRET is set too: Gate's own HS256 tokens keep working.
    r = await reserve_with(idp_client, deal, token(USER_BASE + 9))
    assert r.status_code == 201, r.text


async def test_refused_tokens_are_401_and_change_nothing(idp_client: Client, db: Database) -> None:
    deal = await create_deal(idp_client, stock=50)
    user = USER_BASE + 100
    rsa_pem = RSA_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    claims = {"sub": str(user), "exp": int(time.time()) + 600, "iss": ISSUER, "aud": AUDIENCE}
    none_header = orjson.dumps({"alg": "none", "kid": "ec-1"})
    unsigned = f"{b64url(none_header)}.{b64url(orjson.dumps(claims))}."
    refused = {
        "wrong issuer": signed(EC_KEY, "ES256", "ec-1", user, iss="https://evil.example/"),
        "no issuer": signed(EC_KEY, "ES256", "ec-1", user, iss=None),
        "wrong audience": signed(EC_KEY, "ES256", "ec-1", user, aud="someone-else"),
        "expired": signed(EC_KEY, "ES256", "ec-1", user, ttl_seconds=-30),
        # HMAC keyed with the public key's bytes: the classic algorithm confusion.
        "HS256 with the public key": hs256_by_hand(claims, rsa_pem, "rsa-1"),
        # The key ec-1 is pinned to ES256; an RS256 header (signed with an RSA key) is not it.
        "RS256 header on an EC key": signed(RSA_KEY, "RS256", "ec-1", user),
        "ES256 header on the RSA key": signed(EC_KEY, "ES256", "rsa-1", user),
        "alg none": unsigned,
        "unknown kid": signed(EC_KEY, "ES256", "nobody", user),
        "signed by another key": signed(EC_NEXT, "ES256", "ec-1", user),
    }
    for why, bad in refused.items():
        r = await reserve_with(idp_client, deal, bad)
        assert r.status_code == 401, (why, r.text)
        assert_401(r)
    assert await orders_of(db, user) == 0
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal,))
    assert row == (0,)


async def test_a_rotated_key_is_picked_up_and_a_removed_one_refused(
    idp_client: Client, jwks_server: JwksServer, db: Database
) -> None:
    deal = await create_deal(idp_client, stock=50)
    new_user, old_user = USER_BASE + 200, USER_BASE + 201
    rotated = signed(EC_NEXT, "ES256", "ec-2", new_user)
    assert_401(await reserve_with(idp_client, deal, rotated))
    old = signed(EC_KEY, "ES256", "ec-1", old_user)
    r = await reserve_with(idp_client, deal, old)
    assert r.status_code == 201, r.text  # verified, and now cached
    try:
        jwks_server.keys = [*BASE_KEYS, jwk(EC_NEXT, "ec-2")]
        await until_accepted(idp_client, rotated, True)
        r = await reserve_with(idp_client, deal, rotated)
        assert r.status_code == 201, r.text
        assert await orders_of(db, new_user) == 1

        # ec-1 withdrawn: its token, though verified and cached, stops working.
        jwks_server.keys = [k for k in jwks_server.keys if k["kid"] != "ec-1"]
        await until_accepted(idp_client, old, False)
        assert_401(await reserve_with(idp_client, deal, old))
        assert await orders_of(db, old_user) == 1
        # The other keys' tokens still reserve.
        r = await reserve_with(idp_client, deal, signed(ED_KEY, "EdDSA", "ed-1", old_user + 1))
        assert r.status_code == 201, r.text
    finally:
        jwks_server.keys = list(BASE_KEYS)


async def test_keys_from_a_file_and_no_hs256_without_its_secret(
    prepared: None, tmp_path: Path, db: Database
) -> None:
    path = tmp_path / "jwks.json"
    path.write_bytes(orjson.dumps({"keys": [jwk(EC_KEY, "ec-1")]}))
    env = idp_env(GATE_JWT_JWKS_FILE=str(path))
    del env["GATE_JWT_SECRET"]
    proc = GateProcess(env, workers=1)
    client = Client(proc.url)
    try:
        proc.wait_ready()
        deal = await create_deal(client, stock=10)
        user = USER_BASE + 300
        r = await reserve_with(client, deal, signed(EC_KEY, "ES256", "ec-1", user))
        assert r.status_code == 201, r.text
        # Only a key set configured: HS256 is off, whatever the token's secret.
        assert_401(await reserve_with(client, deal, token(user + 1)))
        # The file is read again: a key added to it works without a restart.
        path.write_bytes(orjson.dumps({"keys": [jwk(EC_KEY, "ec-1"), jwk(ED_KEY, "ed-1")]}))
        added = signed(ED_KEY, "EdDSA", "ed-1", user + 2)
        await until_accepted(client, added, True)
        r = await reserve_with(client, deal, added)
        assert r.status_code == 201, r.text
        assert await orders_of(db, user) == 1 and await orders_of(db, user + 1) == 0
        # `gate token` signs HS256 only: with no secret it refuses, rather than print
        # a token every gate would answer 401.
        minted = await asyncio.to_thread(
            subprocess.run,
            [GATE_BIN, "token", str(user)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert minted.returncode == 2 and not minted.stdout, minted.stdout
        assert "GATE_JWT_SECRET" in minted.stderr, minted.stderr
    finally:
        await client.close()
        proc.stop()


def test_https_is_required_outside_dev() -> None:
    env = {**base_env(), "GATE_JWT_ISSUER": ISSUER, "GATE_JWT_AUDIENCE": AUDIENCE}
    env["GATE_JWT_JWKS_URL"] = "http://id.shop.example/jwks.json"
    with pytest.raises(SettingsError, match="https"):
        load_settings(env)
    env["GATE_JWT_JWKS_URL"] = "https://id.shop.example/jwks.json"
    idp = load_settings(env).jwt_idp
    assert idp is not None and idp.jwks_url == env["GATE_JWT_JWKS_URL"]
    assert idp.refresh_seconds == 300
    env["GATE_ENV"] = "dev"
    env["GATE_JWT_JWKS_URL"] = "http://127.0.0.1:1/jwks.json"
    assert load_settings(env).jwt_idp is not None


def test_issuer_without_a_key_set_and_both_sources_are_refused() -> None:
    env = {**base_env(), "GATE_JWT_AUDIENCE": AUDIENCE}
    with pytest.raises(SettingsError, match="GATE_JWT_JWKS"):
        load_settings(env)
    env["GATE_JWT_JWKS_URL"] = "https://id.shop.example/jwks.json"
    env["GATE_JWT_JWKS_FILE"] = "/etc/jwks.json"
    with pytest.raises(SettingsError, match="not both"):
        load_settings(env)


def test_the_key_set_is_bounded_and_pins_each_key() -> None:
    keys = parse_jwks(orjson.dumps({"keys": BASE_KEYS}))
    assert {kid: k.algorithm_name for kid, k in keys.items()} == {
        "rsa-1": "RS256",
        "ec-1": "ES256",
        "ed-1": "EdDSA",
    }
    oct_key = {"kty": "oct", "kid": "h", "k": "c2VjcmV0"}
    enc_key = {**jwk(EC_KEY, "enc"), "use": "enc"}
    hs_on_rsa = jwk(RSA_KEY, "hs", alg="HS256")
    curve_mismatch = jwk(EC_KEY, "p384", alg="ES384")
    skipped = parse_jwks(
        orjson.dumps({"keys": [oct_key, enc_key, hs_on_rsa, curve_mismatch, BASE_KEYS[1]]})
    )
    assert list(skipped) == ["ec-1"]
    with pytest.raises(JwksError, match="no RSA, EC or Ed25519"):
        parse_jwks(orjson.dumps({"keys": [oct_key]}))
    with pytest.raises(JwksError, match="over"):
        parse_jwks(orjson.dumps({"keys": [BASE_KEYS[1]] * (JWKS_KEYS_MAX + 1)}))
    with pytest.raises(JwksError, match="bytes"):
        parse_jwks(b" " * (JWKS_MAX_BYTES + 1))
    with pytest.raises(JwksError, match="twice"):
        parse_jwks(orjson.dumps({"keys": [BASE_KEYS[1], BASE_KEYS[1]]}))
    with pytest.raises(JwksError, match="not JSON"):
        parse_jwks(b"<html>")


async def test_an_unknown_kid_asks_for_a_refresh_at_most_once_a_minute(tmp_path: Path) -> None:
    path = tmp_path / "jwks.json"
    path.write_bytes(orjson.dumps({"keys": [BASE_KEYS[1]]}))
    now = [1000.0]
    keys = JwksKeys(file=str(path), url=None, refresh_seconds=300, clock=lambda: now[0])
    await keys.load()
    assert keys.due_at() == 1300.0
    assert keys.key_for("ec-1") is not None and keys.key_for(None) is not None
    assert keys.due_at() == 1300.0
    assert keys.key_for("ec-2") is None  # unknown: a refresh is wished for
    assert keys.due_at() == 1000.0 + UNKNOWN_KID_REFRESH_SECONDS
    path.write_bytes(orjson.dumps({"keys": [BASE_KEYS[1], jwk(EC_NEXT, "ec-2")]}))
    now[0] += UNKNOWN_KID_REFRESH_SECONDS
    assert await keys.run_once()
    assert keys.key_for("ec-2") is not None
    assert keys.key_for(None) is None  # two keys: a token must name one
    assert keys.due_at() == now[0] + 300
    # A failed read keeps the keys it had.
    path.write_bytes(b"not json")
    assert not await keys.run_once()
    assert set(keys.keys) == {"ec-1", "ec-2"}


async def test_an_unknown_kid_wakes_the_refresh_loop(jwks_server: JwksServer) -> None:
    """The loop sleeps until the periodic read, but a token naming an unknown kid
    wakes it; the read happens once a minute has passed since the last (the clock
    is moved on here instead of waiting it)."""
    now = [1000.0]
    keys = JwksKeys(file=None, url=jwks_server.url, refresh_seconds=3600, clock=lambda: now[0])
    await keys.load()
    stop = asyncio.Event()
    loop = asyncio.ensure_future(keys.run(stop))
    try:
        jwks_server.keys = [*BASE_KEYS, jwk(EC_NEXT, "ec-2")]
        now[0] += UNKNOWN_KID_REFRESH_SECONDS
        assert keys.key_for("ec-2") is None
        deadline = time.monotonic() + PICKUP_SECONDS
        while keys.key_for("ec-2") is None:
            assert time.monotonic() < deadline, "the loop did not read the set again"
            await asyncio.sleep(0.05)
    finally:
        jwks_server.keys = list(BASE_KEYS)
        stop.set()
        await loop


async def test_a_fetched_set_is_bounded(jwks_server: JwksServer) -> None:
    keys = JwksKeys(file=None, url=jwks_server.url, refresh_seconds=300)
    padding = {"kty": "oct", "kid": "pad", "k": "A" * JWKS_MAX_BYTES}
    try:
        jwks_server.keys = [*BASE_KEYS, padding]
        with pytest.raises(JwksError, match="bytes"):
            await keys.load()
    finally:
        jwks_server.keys = list(BASE_KEYS)
    await keys.load()
    assert set(keys.keys) == {"rsa-1", "ec-1", "ed-1"}
    missing = JwksKeys(file=None, url=jwks_server.url + ".missing", refresh_seconds=300)
    with pytest.raises(JwksError):
        await missing.load()


def test_a_key_set_that_cannot_be_read_stops_start_up(prepared: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}/jwks.json"
    proc = GateProcess(idp_env(GATE_JWT_JWKS_URL=dead), workers=1)
    try:
        with pytest.raises(RuntimeError, match="gate exited early"):
            proc.wait_ready(timeout_seconds=60)
        assert proc.proc.wait(timeout=10) != 0
        assert "reading the key set from" in proc.output()
    finally:
        proc.stop()
