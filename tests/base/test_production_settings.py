"""Production refuses development values: the built-in dev secrets outside
GATE_ENV=dev, a plain-http payment provider off loopback, a provider without an API
key, a key set without an issuer and an audience, a short admin token. Real `gate
serve` processes: exit 2 naming the variable, before any I/O."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gate.base.settings import (
    DEV_ADMIN_TOKEN,
    DEV_JWT_SECRET,
    DEV_WEBHOOK_SECRET,
    SettingsError,
    load_settings,
)
from gate.payments.config import load_payment_settings
from tests.support import GATE_BIN, WEBHOOK_SECRET, serve_once

API_KEY = "test-provider-api-key-0123456789"


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
        # The same key bytes written without the base64 padding (the signer re-pads).
        ("GATE_WEBHOOK_SECRET", DEV_WEBHOOK_SECRET.rstrip("=")),
        ("GATE_WEBHOOK_SECRET", f"{WEBHOOK_SECRET} {DEV_WEBHOOK_SECRET.rstrip('=')}"),
        # Whitespace around a value is not a different value.
        ("GATE_JWT_SECRET", f"  {DEV_JWT_SECRET}\t"),
        ("GATE_ADMIN_TOKEN", f"\n{DEV_ADMIN_TOKEN} "),
    ):
        given = {**env, "GATE_ENV": gate_env, name: value}
        with pytest.raises(SettingsError, match=f"{name} is the public development value"):
            load_settings(given)
        out = serve_once(given)
        assert out.returncode == 2, (name, out.stderr)
        assert f"{name} is the public development value" in out.stderr
        assert "Traceback" not in out.stderr
        assert value.split()[-1] not in out.stdout + out.stderr


@pytest.mark.parametrize("gate_env", ["production", "test"])
def test_the_values_published_in_the_dev_compose_file_are_refused_outside_dev(
    env: dict[str, str], gate_env: str
) -> None:
    """docker-compose.dev.yml publishes the sandbox's API key and the development
    database and Redis passwords; a gate outside dev refuses them (exit 2, named)."""
    for name, value in (
        ("GATE_PAYMENT_API_KEY", "gate-dev-sandbox-api-key"),
        ("GATE_MYSQL_URL", "mysql://gate_app:gate-dev-app-password@127.0.0.1:3306/gate"),
        ("GATE_MYSQL_URL", "mysql://root:gate-dev-root@127.0.0.1:3306/gate"),
        ("GATE_REDIS_URL", "redis://:gate-dev-redis@127.0.0.1:6379/0"),
    ):
        given = {**env, "GATE_ENV": gate_env, name: value}
        if name == "GATE_PAYMENT_API_KEY":
            given["GATE_PAYMENT_PROVIDER_URL"] = "https://psp.example.com"
            with pytest.raises(SettingsError, match=f"{name} is the public development value"):
                load_payment_settings(given)
        else:
            with pytest.raises(SettingsError, match=f"{name} \\(its password\\) is the public"):
                load_settings(given)
        out = serve_once(given)
        assert out.returncode == 2, (name, out.stderr)
        assert f"{name}" in out.stderr and "public development value" in out.stderr
        assert "Traceback" not in out.stderr
        assert "gate-dev-" not in out.stdout + out.stderr
    # And migrate refuses the published app-user password.
    out = subprocess.run(
        [GATE_BIN, "migrate"],
        env={
            **env,
            "GATE_ENV": gate_env,
            "GATE_MYSQL_APP_USER": "gate_app_fix",
            "GATE_MYSQL_APP_PASSWORD": "gate-dev-app-password",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "GATE_MYSQL_APP_PASSWORD is the public development value" in out.stderr
    # In dev they are what the compose file runs with.
    dev = {**env, "GATE_ENV": "dev", "GATE_PAYMENT_API_KEY": "gate-dev-sandbox-api-key"}
    assert load_payment_settings(dev).provider_api_key is not None
    url = "mysql://gate_app:gate-dev-app-password@127.0.0.1:3306/gate"
    assert load_settings({**dev, "GATE_MYSQL_URL": url}).mysql.user == "gate_app"


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
        # Nor a loopback address: https without exception outside dev.
        ("http://127.0.0.1:8090", API_KEY, "GATE_PAYMENT_PROVIDER_URL must be https://"),
        ("http://[::1]:8090", API_KEY, "GATE_PAYMENT_PROVIDER_URL must be https://"),
        ("https://psp.example.com", "", "GATE_PAYMENT_API_KEY is required"),
        ("https://127.0.0.1:8443", "", "GATE_PAYMENT_API_KEY is required"),
    ):
        given = {**base, "GATE_PAYMENT_PROVIDER_URL": url, "GATE_PAYMENT_API_KEY": key}
        with pytest.raises(SettingsError, match=message):
            load_payment_settings(given)
        out = serve_once(given)
        assert out.returncode == 2, (url, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr
        assert not key or key not in out.stdout + out.stderr
    # https with a key, to a name or an address.
    for url in ("https://psp.example.com", "https://127.0.0.1:8443", "https://[::1]:8443"):
        payments = load_payment_settings(
            {**base, "GATE_PAYMENT_PROVIDER_URL": url, "GATE_PAYMENT_API_KEY": API_KEY}
        )
        assert payments.provider_url == url
        assert payments.provider_api_key is not None
    # No provider at all: payments are off and nothing is required.
    assert load_payment_settings(base).provider_url is None


def test_a_key_set_needs_an_issuer_and_an_audience_outside_dev(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Without both, any token the identity provider signs for any of its
    applications would buy: a JWKS outside dev without GATE_JWT_ISSUER and
    GATE_JWT_AUDIENCE stops start-up (exit 2) saying so."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": []}')
    issuer, audience = "https://id.shop.example/", "gate-buyers"
    for source in (
        {"GATE_JWT_JWKS_FILE": str(jwks)},
        {"GATE_JWT_JWKS_URL": "https://id.example/k"},
    ):
        for claims in ({}, {"GATE_JWT_ISSUER": issuer}, {"GATE_JWT_AUDIENCE": audience}):
            given = {**env, "GATE_ENV": "production", **source, **claims}
            with pytest.raises(SettingsError, match="GATE_JWT_ISSUER and GATE_JWT_AUDIENCE"):
                load_settings(given)
            out = serve_once(given)
            assert out.returncode == 2, out.stderr
            assert "need GATE_JWT_ISSUER and GATE_JWT_AUDIENCE" in out.stderr, out.stderr
        both = {"GATE_JWT_ISSUER": issuer, "GATE_JWT_AUDIENCE": audience}
        idp = load_settings({**env, "GATE_ENV": "production", **source, **both}).jwt_idp
        assert idp is not None and (idp.issuer, idp.audience) == (issuer, audience)
        # A developer's provider may issue tokens without them.
        assert load_settings({**env, "GATE_ENV": "dev", **source}).jwt_idp is not None


def test_the_admin_token_is_at_least_32_characters_outside_dev(env: dict[str, str]) -> None:
    short = "a-31-character-admin-token-0123"
    assert len(short) == 31
    given = {**env, "GATE_ENV": "production", "GATE_ADMIN_TOKEN": short}
    with pytest.raises(SettingsError, match="GATE_ADMIN_TOKEN must be at least 32 characters"):
        load_settings(given)
    out = serve_once(given)
    assert out.returncode == 2 and "GATE_ADMIN_TOKEN must be at least 32" in out.stderr
    assert short not in out.stdout + out.stderr
    assert load_settings({**given, "GATE_ADMIN_TOKEN": short + "4"}).admin_token.reveal()
    assert load_settings({**given, "GATE_ENV": "dev"}).admin_token.reveal() == short


def test_missing_secrets_are_named_together(env: dict[str, str]) -> None:
    """A gate (or a CLI command) without its secrets names every one it needs, at
    once, and how to give each."""
    required = ("GATE_JWT_SECRET", "GATE_ADMIN_TOKEN", "GATE_ADMISSION_SECRET")
    given = {k: v for k, v in env.items() if k not in required}
    with pytest.raises(SettingsError) as refused:
        load_settings({**given, "GATE_ENV": "production"})
    message = str(refused.value)
    assert message.startswith(
        "GATE_JWT_SECRET, GATE_ADMIN_TOKEN, GATE_ADMISSION_SECRET are required: set each"
    ), message
    assert "NAME_FILE" in message and "GATE_ENV=dev" in message
    assert "GATE_WEBHOOK_SECRET" not in message
