"""The provider plumbing: GATE_PAYMENT_PROVIDER picks an adapter, start-up
refuses a missing or unknown provider naming the variable (real `gate serve`, exit 2),
and the webhook route answers a {provider} other than the configured one with a 404
problem+json that records nothing."""

from __future__ import annotations

import pytest

from gate.base.settings import SettingsError, load_settings
from gate.payments.adapters import load_adapter
from gate.payments.config import PROVIDER_NAMES, load_payment_settings
from gate.payments.providers.sandbox import StandardWebhook
from gate.store.db import Database
from tests.payments_support import event_body, signed
from tests.support import Client, serve_once


@pytest.mark.parametrize("gate_env", ["production", "test"])
def test_the_provider_is_required_outside_dev(env: dict[str, str], gate_env: str) -> None:
    given = {k: v for k, v in env.items() if k != "GATE_PAYMENT_PROVIDER"}
    given["GATE_ENV"] = gate_env
    with pytest.raises(SettingsError, match="GATE_PAYMENT_PROVIDER is required"):
        load_payment_settings(given)
    out = serve_once(given)
    assert out.returncode == 2, out.stderr
    assert "GATE_PAYMENT_PROVIDER is required" in out.stderr
    assert "Traceback" not in out.stderr
    # With GATE_ENV=dev the sandbox is the default.
    assert load_payment_settings({**given, "GATE_ENV": "dev"}).provider == "sandbox"


@pytest.mark.parametrize("name", ["paypal", "Stripe", "sandbox_x", "x" * 40, "stripe "])
def test_an_unknown_provider_is_refused_at_start_up(env: dict[str, str], name: str) -> None:
    given = {**env, "GATE_PAYMENT_PROVIDER": name}
    if name.strip() in PROVIDER_NAMES:
        # Surrounding blanks are not a different name.
        assert load_payment_settings(given).provider == name.strip()
        return
    with pytest.raises(SettingsError, match="GATE_PAYMENT_PROVIDER must be one of"):
        load_payment_settings(given)
    out = serve_once(given)
    assert out.returncode == 2, out.stderr
    assert "GATE_PAYMENT_PROVIDER must be one of sandbox, stripe, alipay, wechatpay" in out.stderr


def test_the_sandbox_adapter_is_chosen_by_name(env: dict[str, str]) -> None:
    settings = load_settings(env)
    for name in ("sandbox", "sandbox-rec"):
        payment = load_payment_settings({**env, "GATE_PAYMENT_PROVIDER": name})
        adapter = load_adapter(env, payment, is_dev=False, webhook_secrets=settings.webhook_secrets)
        assert adapter.name == name
        assert isinstance(adapter.webhook, StandardWebhook)
        # No GATE_PAYMENT_PROVIDER_URL: callbacks are taken, nobody is called.
        assert adapter.provider is None


async def test_a_webhook_for_another_provider_is_404_and_records_nothing(
    client: Client, db: Database
) -> None:
    async def events() -> int:
        row = await db.fetchone("SELECT COUNT(*) FROM payment_events")
        assert row is not None
        return int(row[0])

    before = await events()
    body = event_body("payment.succeeded", "01J00000000000000000000000", "pay_x", 100)
    for provider in ("paypal", "stripe", "alipay", "wechatpay", "sandbox-other"):
        # Even a body the sandbox signed: the suite's gate is the sandbox's, not theirs.
        r = await client.post(
            f"/v1/payments/{provider}/webhook", content=body, headers=signed(body)
        )
        assert r.status_code == 404, (provider, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "NOT_FOUND"
    assert await events() == before
