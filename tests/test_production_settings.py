"""Production refuses development values (#12.5): the built-in dev secrets outside
GATE_ENV=dev, a plain-http payment provider off loopback, a provider without an API
key. Real `gate serve` processes: exit 2 naming the variable, before any I/O."""

from __future__ import annotations

import subprocess

import pytest

from gate.payments.config import load_payment_settings
from gate.settings import (
    DEV_ADMIN_TOKEN,
    DEV_JWT_SECRET,
    DEV_WEBHOOK_SECRET,
    SettingsError,
    load_settings,
)
from tests.support import GATE_BIN, WEBHOOK_SECRET

API_KEY = "test-provider-api-key-0123456789"


def serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Port 1: were the configuration accepted, binding would fail loudly instead.
    return subprocess.run(
        [GATE_BIN, "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("gate_env", ["production", "test"])
def test_the_built_in_dev_secrets_are_refused_outside_dev(
    env: dict[str, str], gate_env: str
) -> None:
    for name, value in (
        ("GATE_JWT_SECRET", DEV_JWT_SECRET),
        ("GATE_ADMIN_TOKEN", DEV_ADMIN_TOKEN),
        ("GATE_WEBHOOK_SECRET", DEV_WEBHOOK_SECRET),
        # Also as one entry of a rotation list.
        ("GATE_WEBHOOK_SECRET", f"{WEBHOOK_SECRET} {DEV_WEBHOOK_SECRET}"),
    ):
        given = {**env, "GATE_ENV": gate_env, name: value}
        with pytest.raises(SettingsError, match=f"{name} is the public development value"):
            load_settings(given)
        out = serve(given)
        assert out.returncode == 2, (name, out.stderr)
        assert f"{name} is the public development value" in out.stderr
        assert "Traceback" not in out.stderr
        assert value.split()[-1] not in out.stdout + out.stderr


def test_dev_mode_still_takes_the_dev_secrets(env: dict[str, str]) -> None:
    dev = {
        **env,
        "GATE_ENV": "dev",
        "GATE_JWT_SECRET": DEV_JWT_SECRET,
        "GATE_ADMIN_TOKEN": "",
        "GATE_WEBHOOK_SECRET": "",
    }
    settings = load_settings(dev)
    assert settings.jwt_secret.reveal() == DEV_JWT_SECRET
    assert set(settings.dev_secrets_used) == {"GATE_ADMIN_TOKEN", "GATE_WEBHOOK_SECRET"}
    # And a dev gate may talk plain http to the compose sandbox, without a key.
    payments = load_payment_settings({**dev, "GATE_PAYMENT_PROVIDER_URL": "http://sandbox:8090"})
    assert payments.provider_url == "http://sandbox:8090"


@pytest.mark.parametrize("gate_env", ["production", "test"])
def test_the_payment_provider_needs_https_and_a_key_outside_dev(
    env: dict[str, str], gate_env: str
) -> None:
    base = {**env, "GATE_ENV": gate_env}
    for url, key, message in (
        ("http://psp.example.com", API_KEY, "GATE_PAYMENT_PROVIDER_URL must be https://"),
        ("http://10.0.0.5:8090", API_KEY, "GATE_PAYMENT_PROVIDER_URL must be https://"),
        # A name is not trusted to be loopback: it resolves.
        ("http://localhost:8090", API_KEY, "GATE_PAYMENT_PROVIDER_URL must be https://"),
        ("https://psp.example.com", "", "GATE_PAYMENT_API_KEY is required"),
        ("http://127.0.0.1:8090", "", "GATE_PAYMENT_API_KEY is required"),
    ):
        given = {**base, "GATE_PAYMENT_PROVIDER_URL": url, "GATE_PAYMENT_API_KEY": key}
        with pytest.raises(SettingsError, match=message):
            load_payment_settings(given)
        out = serve(given)
        assert out.returncode == 2, (url, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr
        assert not key or key not in out.stdout + out.stderr
    # https with a key; plain http to a loopback address (a sidecar, the test sandbox).
    for url in ("https://psp.example.com", "http://127.0.0.1:8090", "http://[::1]:8090"):
        payments = load_payment_settings(
            {**base, "GATE_PAYMENT_PROVIDER_URL": url, "GATE_PAYMENT_API_KEY": API_KEY}
        )
        assert payments.provider_url == url
        assert payments.provider_api_key is not None
    # No provider at all: payments are off and nothing is required.
    assert load_payment_settings(base).provider_url is None
