"""The webhooks' rules without services: URLs refused and allowed (the hostile table),
the resolver's check of each address, sealed secrets, settings, the retry decision,
signatures the standardwebhooks library verifies."""

from __future__ import annotations

import ipaddress
import socket
from datetime import UTC, datetime
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from gate.base.backoff import Schedule
from gate.base.settings import Secret, SettingsError
from gate.base.standard_webhooks import new_secret, parse_secret, sign_headers
from gate.webhooks import events as ev
from gate.webhooks.config import (
    DEV_ENCRYPTION_KEY,
    AllowedHosts,
    load_webhook_settings,
    parse_allowed_hosts,
)
from gate.webhooks.dispatcher import Dispatcher
from gate.webhooks.model import Claimed
from gate.webhooks.sender import Outcome
from gate.webhooks.ssrf import CheckingResolver, UrlRefused, check_resolved, check_url
from gate.webhooks.vault import NoKey, Vault, VaultError

NONE = AllowedHosts()

HOSTILE = [
    ("http://shop.example/hook", "http://"),
    ("ftp://shop.example/hook", "https://"),
    ("https://user:pw@shop.example/hook", "credentials"),
    ("https://user@shop.example/hook", "credentials"),
    ("https://shop.example/hook#frag", "fragment"),
    ("https://127.0.0.1/hook", "loopback"),
    ("https://127.1.2.3/hook", "loopback"),
    ("https://10.0.0.8/hook", "private"),
    ("https://172.16.5.4/hook", "private"),
    ("https://192.168.1.1/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "link-local"),
    ("https://0.0.0.0/hook", "unspecified"),
    ("https://224.0.0.1/hook", "multicast"),
    ("https://255.255.255.255/hook", "private|reserved"),
    ("https://100.64.0.1/hook", "shared"),
    ("https://192.0.2.10/hook", "private"),
    ("https://[::1]/hook", "loopback"),
    ("https://[::]/hook", "unspecified"),
    ("https://[fe80::1]/hook", "link-local"),
    ("https://[fd00::1]/hook", "private"),
    ("https://[ff02::1]/hook", "multicast"),
    ("https://[::ffff:127.0.0.1]/hook", "loopback"),
    ("https://[::ffff:10.1.2.3]/hook", "private"),
    ("https://[::ffff:169.254.169.254]/hook", "link-local"),
    ("https://[::127.0.0.1]/hook", "IPv4-compatible"),
    ("https://[64:ff9b::7f00:1]/hook", "loopback"),
    ("https://[2002:7f00:1::1]/hook", "loopback"),
    ("https://[2002:a00:1::1]/hook", "private"),
    ("https://[fe80::1%25eth0]/hook", "zone"),
    ("https://2130706433/hook", "dotted-quad"),
    ("https://0x7f000001/hook", "dotted-quad"),
    ("https://127.1/hook", "dotted-quad"),
    ("https://0177.0.0.1/hook", "dotted-quad"),
    ("https://0x7f.0.0.1/hook", "dotted-quad"),
    ("https:///hook", "no host"),
    ("https://shop.example:0/hook", "port 0"),
    ("https://shop.example:99999/hook", "malformed"),
    ("https://shop example/hook", "printable"),
    ("https://shöp.example/hook", "printable"),
    ("https://shop.example/h\x00ok", "printable"),
    ("https://" + "a" * 2100 + ".example/", "longer"),
    ("https://-bad-.example/hook", "host name"),
    ("", "empty"),
]


@pytest.mark.parametrize(("url", "why"), HOSTILE)
def test_hostile_urls_are_refused_by_their_form_or_address(url: str, why: str) -> None:
    with pytest.raises(UrlRefused, match=why):
        check_url(url, NONE, dev=False)


@pytest.mark.parametrize(
    "url",
    [
        "https://shop.example/hooks/gate?x=1",
        "https://SHOP.example:8443/hooks",
        "https://1.1.1.1/hook",
        "https://[2606:4700:4700::1111]/hook",
        "https://[64:ff9b::101:101]/hook",
    ],
)
def test_https_to_a_name_or_public_address_is_accepted(url: str) -> None:
    target = check_url(url, NONE, dev=False)
    assert target.scheme == "https" and not target.listed


async def test_names_that_resolve_to_loopback_are_refused() -> None:
    target = check_url("https://localhost/hook", NONE, dev=False)
    with pytest.raises(UrlRefused, match=r"resolves to .*loopback"):
        await check_resolved(target, NONE, dev=False)
    with pytest.raises(UrlRefused, match="does not resolve"):
        target = check_url("https://no-such-host.invalid/hook", NONE, dev=False)
        await check_resolved(target, NONE, dev=False)


async def test_the_resolver_refuses_a_name_whose_address_is_not_permitted() -> None:
    """What a delivery connects through: `localhost` answers loopback addresses, so the
    connector never gets an address for it (DNS rebinding gains nothing)."""
    resolver = CheckingResolver(NONE, dev=False)
    try:
        with pytest.raises(UrlRefused, match="loopback"):
            await resolver.resolve("localhost", 443, socket.AF_UNSPEC)
        listed = CheckingResolver(parse_allowed_hosts("127.0.0.0/8"), dev=False)
        found = await listed.resolve("localhost", 443, socket.AF_INET)
        assert {r["host"] for r in found} == {"127.0.0.1"}
        await listed.close()
    finally:
        await resolver.close()


def test_allowed_hosts_lift_the_rules_and_allow_http() -> None:
    allowed = parse_allowed_hosts("hooks.internal, 10.20.0.0/16 ,[fd00::]/8,127.0.0.1")
    assert check_url("http://hooks.internal:8080/x", allowed, dev=False).listed
    assert check_url("http://10.20.3.4/x", allowed, dev=False).literal is not None
    assert check_url("https://[fd00::5]/x", allowed, dev=False).literal is not None
    assert check_url("http://127.0.0.1:9000/x", allowed, dev=False).port == 9000
    with pytest.raises(UrlRefused, match="private"):
        check_url("https://10.21.0.1/x", allowed, dev=False)
    with pytest.raises(UrlRefused, match="http://"):
        check_url("http://public.example/x", allowed, dev=False)
    # Credentials stay refused, listed or not, dev or not.
    with pytest.raises(UrlRefused, match="credentials"):
        check_url("http://u:p@hooks.internal/x", allowed, dev=True)
    # A developer's receiver on localhost, over http, with GATE_ENV=dev.
    assert check_url("http://127.0.0.1:8000/hook", NONE, dev=True).scheme == "http"
    for bad in ("not a host!", "999.1.1.1/40", "a" * 300):
        with pytest.raises(SettingsError):
            parse_allowed_hosts(bad)


def test_secrets_are_sealed_bound_to_their_endpoint_and_key() -> None:
    vault = Vault([Secret("k" * 40)])
    secret = vault.new_secret()
    assert secret.startswith("whsec_") and 24 <= len(parse_secret(secret)) <= 64
    sealed = vault.seal("01JD3W9K2XG5W7Q8M4Z6V1R0TB", secret)
    assert secret not in sealed and secret[6:] not in sealed
    assert vault.open("01JD3W9K2XG5W7Q8M4Z6V1R0TB", sealed) == secret
    with pytest.raises(VaultError):
        vault.open("01JD3W9K2XG5W7Q8M4Z6V1R0TC", sealed)  # moved to another row
    with pytest.raises(VaultError, match="does not list"):
        Vault([Secret("z" * 40)]).open("01JD3W9K2XG5W7Q8M4Z6V1R0TB", sealed)
    # A new key in front: the old one still opens what it sealed; new seals use the new.
    both = Vault([Secret("z" * 40), Secret("k" * 40)])
    assert both.open("01JD3W9K2XG5W7Q8M4Z6V1R0TB", sealed) == secret
    assert both.seal("E", secret).split(".")[1] != sealed.split(".")[1]
    with pytest.raises(NoKey):
        Vault([]).seal("E", secret)
    assert new_secret(24) != new_secret(24)


def test_settings_defaults_and_their_refusals() -> None:
    prod = load_webhook_settings({}, dev=False)
    assert prod.schedule.steps_seconds == (5, 300, 1800, 7200, 18000, 36000, 36000)
    assert prod.schedule.attempts_max == 8
    assert (prod.timeout_seconds, prod.rotation_overlap_seconds, prod.endpoints_max) == (
        10.0,
        86_400,
        20,
    )
    assert prod.encryption_keys == ()  # no key of its own: endpoints answer 409
    dev = load_webhook_settings({}, dev=True)
    assert dev.encryption_keys == (Secret(DEV_ENCRYPTION_KEY),)
    fast = load_webhook_settings({"GATE_WEBHOOK_RETRY_SCHEDULE": "0.2, 0.2,1"}, dev=False)
    assert fast.schedule.steps_seconds == (0.2, 0.2, 1.0)
    for env in (
        {"GATE_WEBHOOK_RETRY_SCHEDULE": "5,,300"},
        {"GATE_WEBHOOK_RETRY_SCHEDULE": "-1"},
        {"GATE_WEBHOOK_RETRY_SCHEDULE": ",".join(["1"] * 21)},
        {"GATE_WEBHOOK_ENCRYPTION_KEY": "short"},
        {"GATE_WEBHOOK_ENCRYPTION_KEY": DEV_ENCRYPTION_KEY},
        {"GATE_WEBHOOK_TIMEOUT_SECONDS": "0"},
        {"GATE_WEBHOOK_MAX_ENDPOINTS": "0"},
    ):
        with pytest.raises(SettingsError):
            load_webhook_settings(env, dev=False)


def _claimed(attempt: int) -> Claimed:
    return Claimed(1, "E", attempt, "evt", b"{}", datetime.now(UTC).replace(tzinfo=None), "t")


def _outcome(kind: str, status: int | None, retry_after: float | None = None) -> Outcome:
    return Outcome(datetime.now(UTC).replace(tzinfo=None), 5, status, None, retry_after, kind)


def test_the_retry_decision_follows_the_schedule_and_retry_after() -> None:
    settings = load_webhook_settings({"GATE_WEBHOOK_RETRY_SCHEDULE": "5,300"}, dev=False)
    d: Any = Dispatcher.__new__(Dispatcher)
    d.settings = settings
    assert d.decide(_claimed(1), _outcome("delivered", 204)).state == "delivered"
    retry = d.decide(_claimed(1), _outcome("http_error", 500))
    assert retry.state == "retry" and 4.0 <= retry.next_delay_seconds <= 5.0
    # Retry-After is honoured up to the step: less, not more.
    assert d.decide(_claimed(2), _outcome("http_error", 503, 60)).next_delay_seconds == 60
    assert d.decide(_claimed(1), _outcome("http_error", 503, 3600)).next_delay_seconds == 5
    assert d.decide(_claimed(3), _outcome("timeout", None)).state == "failed"
    gone = d.decide(_claimed(1), _outcome("gone", 410))
    assert gone.gone and gone.state == "retry"


def test_signatures_verify_with_the_standardwebhooks_library() -> None:
    old, new = new_secret(), new_secret()
    body = ev.body("order.paid", "2026-12-01T10:00:00.000000Z", {"order_id": "X", "sequence": 1})
    headers = sign_headers([parse_secret(new), parse_secret(old)], "01JD3W", 1_900_000_000, body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (new, old):
        hook: Any = Webhook(secret)
        # The library checks the timestamp against its clock: sign now instead.
        fresh = sign_headers([parse_secret(new), parse_secret(old)], "01JD3W", _now(), body)
        assert hook.verify(body, fresh)["type"] == "order.paid"


def _now() -> int:
    return int(datetime.now(UTC).timestamp())


def test_events_and_subscriptions() -> None:
    assert ev.subscribed(["*"], "order.paid", "E", None)
    assert ev.subscribed(["order.paid"], "order.paid", "E", None)
    assert not ev.subscribed(["order.paid"], "order.expired", "E", None)
    assert ev.subscribed([], ev.TEST_TYPE, "E", "E")
    assert not ev.subscribed(["*"], ev.TEST_TYPE, "F", "E")
    data = ev.order_data(
        {"order_id": "O", "status": "PAID", "provider": "stripe", "amount": 700, "reason": None},
        (42, 7, 1, 700, "EUR"),
        3,
    )
    assert data["deal_id"] == 42 and data["amount"] == 700 and data["sequence"] == 3
    assert data["payment"]["provider"] == "stripe" and "reason" not in data
    rejected = ev.order_data(
        {
            "order_id": "Q",
            "deal_id": 5,
            "user_id": 9,
            "quantity": 2,
            "status": "REJECTED",
            "reason": "SOLD_OUT",
            "order_amount": 1000,
            "order_currency": "EUR",
        },
        None,
        1,
    )
    assert (rejected["amount"], rejected["currency"], rejected["reason"]) == (
        1000,
        "EUR",
        "SOLD_OUT",
    )
    assert ipaddress.ip_address("1.1.1.1").is_global
    assert Schedule.parse("5").attempts_max == 2


def test_slots_are_shared_among_the_endpoints_with_work() -> None:
    settings = load_webhook_settings(
        {"GATE_WEBHOOK_CONCURRENCY": "8", "GATE_WEBHOOK_ENDPOINT_CONCURRENCY": "6"}, dev=False
    )
    d: Any = Dispatcher.__new__(Dispatcher)
    d.settings = settings
    d.in_flight, d._full = {}, set()
    # Nothing known yet: one slot each, to find out.
    assert d._free_slots(["A", "B", "C"]) == {"A": 1, "B": 1, "C": 1}
    # A is busy alone: it may take its own cap; the idle ones still get one each.
    d._full = {"A"}
    assert d._free_slots(["A", "B", "C"]) == {"A": 6, "B": 1, "C": 1}
    # A hangs with its 4 slots of an even share (8 // 2); B busy too: B gets its share.
    d.in_flight, d._full = {"A": 4}, {"B"}
    assert d._free_slots(["A", "B", "C"]) == {"B": 4}
