"""Secrets from files (gate/base/settings.py `with_secret_files`): every variable of
SECRET_NAMES may be given as NAME_FILE, as Docker and Kubernetes mount secrets.

Generated from SECRET_NAMES, for each secret:
- its file's content (one trailing newline stripped) reaches the code that uses it,
  and a bad value from the file is refused there, the message naming the variable
  and never the value;
- NAME and NAME_FILE both set stop `gate serve` (exit 2) naming both;
- an unreadable file stops start-up naming NAME_FILE.
A scan of gate/ keeps SECRET_NAMES complete, and a gate whose every core secret comes
from a file serves a reservation.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gate.api.ops import _secrets
from gate.base.settings import (
    DEV_SANDBOX_API_KEY,
    SECRET_FILE_MAX_BYTES,
    SECRET_NAMES,
    SettingsError,
    load_settings,
)
from gate.console import ConsoleSettings
from gate.payments.config import load_payment_settings
from gate.payments.providers.stripe import StripeSettings
from gate.payments.providers.wechatpay import load_wechatpay_settings
from gate.payments.sandbox.server import load_config
from gate.payments.signing import decode_secret
from gate.store.migrate import load_app_user
from gate.webhooks.config import load_webhook_settings
from tests.support import (
    ADMIN,
    ADMIN_TOKEN,
    ADMISSION_SECRET,
    JWT_SECRET,
    ROOT,
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    create_deal,
    reserve,
    serve_once,
)

SANDBOX_SECRET = "whsec_c2FuZGJveC13ZWJob29rLXNlY3JldC0wMTIzNDU2"


def _settings(env: Mapping[str, str]) -> Any:
    return load_settings(env)


def _sandbox(env: Mapping[str, str]) -> Any:
    return load_config(env, "127.0.0.1", 8090)


@dataclass(frozen=True)
class Use:
    """Where a secret is used: `read` loads what uses it (from the environment, no
    I/O) and returns the value as held there, `expect` for the good value; `bad`
    is refused there with `error` in the message (None: any value is taken)."""

    good: str
    read: Callable[[Mapping[str, str]], Any]
    bad: str | None = None
    error: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    expect: Any = None


WECHATPAY = {
    "GATE_PAYMENT_PROVIDER": "wechatpay",
    "GATE_WECHATPAY_MCHID": "1900000001",
    "GATE_WECHATPAY_APPID": "wx0123456789",
    "GATE_WECHATPAY_PRIVATE_KEY_FILE": "/nonexistent/apiclient_key.pem",
    "GATE_WECHATPAY_CERT_SERIAL": "ABCDEF0123",
}
STRIPE = {"GATE_PAYMENT_PROVIDER": "stripe"}

USES: dict[str, Use] = {
    "GATE_JWT_SECRET": Use(
        "jwt-secret-from-a-file-0123456789abcdef",
        lambda env: _settings(env).jwt_secret.reveal(),
        "short-jwt",
        "GATE_JWT_SECRET must be at least 32 characters",
    ),
    "GATE_ADMIN_TOKEN": Use(
        "admin-token-from-a-file-0123456789abcdef",
        lambda env: _settings(env).admin_token.reveal(),
        "short-adm",
        "GATE_ADMIN_TOKEN must be at least 32 characters",
    ),
    "GATE_WEBHOOK_SECRET": Use(
        SANDBOX_SECRET,
        lambda env: _settings(env).webhook_secrets[0].reveal(),
        "not-a-webhook-secret-value",
        "GATE_WEBHOOK_SECRET entries must look like whsec_",
    ),
    "GATE_ADMISSION_SECRET": Use(
        "admission-secret-from-a-file-0123456789",
        lambda env: _settings(env).admission_secret.reveal(),
        "short-admission",
        "GATE_ADMISSION_SECRET must be at least 32 characters",
    ),
    "GATE_CONSOLE_SECRET": Use(
        "console-secret-from-a-file-0123456789",
        lambda env: ConsoleSettings.from_env(_settings(env).environ, _settings(env)).secret,
        "short-console",
        "GATE_CONSOLE_SECRET must be at least 32 characters",
    ),
    "GATE_MYSQL_URL": Use(
        "mysql://gate:password-from-a-file@127.0.0.1:3306/gate_from_file",
        lambda env: _settings(env).mysql.password.reveal(),
        "mysql://gate:sentinel-db-password@127.0.0.1:3306/not-a-name!",
        "GATE_MYSQL_URL database name must be",
        expect="password-from-a-file",
    ),
    "GATE_MYSQL_APP_PASSWORD": Use(
        "app-password-from-a-file",
        lambda env: load_app_user(_settings(env).environ, _settings(env).mysql).password.reveal(),
        "short-app-pw",
        "GATE_MYSQL_APP_PASSWORD is required with GATE_MYSQL_APP_USER",
        extra={"GATE_MYSQL_APP_USER": "gate_app_from_file"},
    ),
    "GATE_REDIS_URL": Use(
        "redis://:redis-password-from-a-file@127.0.0.1:6379/13",
        lambda env: _settings(env).redis_url,
        "redis://:sentinel-redis-password@127.0.0.1:6379/notanumber",
        "GATE_REDIS_URL database must be a number",
    ),
    "GATE_PAYMENT_API_KEY": Use(
        "payment-api-key-from-a-file",
        lambda env: load_payment_settings(_settings(env).environ).provider_api_key.reveal(),
        DEV_SANDBOX_API_KEY,
        "GATE_PAYMENT_API_KEY is the public development value",
    ),
    "GATE_STRIPE_API_KEY": Use(
        "sk_test_from_a_file_0123456789",
        lambda env: StripeSettings(_settings(env).environ, False).api_key.reveal(),
        "not-a-stripe-key-sentinel",
        "GATE_STRIPE_API_KEY must be a Stripe secret or restricted key",
        extra={**STRIPE, "GATE_STRIPE_WEBHOOK_SECRET": "whsec_stripe0123456789"},
    ),
    "GATE_STRIPE_WEBHOOK_SECRET": Use(
        "whsec_stripe_from_a_file_0123",
        lambda env: StripeSettings(_settings(env).environ, False).webhook_secrets[0].reveal(),
        "not-a-stripe-webhook-secret",
        "GATE_STRIPE_WEBHOOK_SECRET must be 1-4 space-separated whsec_",
        extra={**STRIPE, "GATE_STRIPE_API_KEY": "sk_test_0123456789"},
    ),
    "GATE_WECHATPAY_APIV3_KEY": Use(
        "0123456789abcdef0123456789ABCDEF",
        # The key is checked before the private key file is read (which fails here).
        lambda env: _settings(env).environ["GATE_WECHATPAY_APIV3_KEY"],
        "short-apiv3-sentinel",
        "GATE_WECHATPAY_APIV3_KEY must be the 32-character APIv3 key",
        extra=WECHATPAY,
    ),
    "GATE_SANDBOX_API_KEY": Use(
        "sandbox-api-key-from-a-file",
        lambda env: _sandbox(env).api_key,
        extra={"GATE_ENV": "dev"},
    ),
    "GATE_SANDBOX_WEBHOOK_SECRET": Use(
        SANDBOX_SECRET,
        lambda env: _sandbox(env).signing_keys[0],
        "not-a-sandbox-webhook-secret",
        "webhook secrets (GATE_WEBHOOK_SECRET, GATE_SANDBOX_WEBHOOK_SECRET) must look like",
        extra={"GATE_ENV": "dev"},
        expect=decode_secret(SANDBOX_SECRET),
    ),
    "GATE_WEBHOOK_ENCRYPTION_KEY": Use(
        "webhook-encryption-key-from-a-file-0123456789",
        lambda env: (
            load_webhook_settings(_settings(env).environ, _settings(env).is_dev)
            .encryption_keys[0]
            .reveal()
        ),
        "short-webhook-key",
        "GATE_WEBHOOK_ENCRYPTION_KEY: each key must be at least 32 characters",
    ),
}


def _bad_value_check(name: str) -> Callable[[Mapping[str, str]], Any]:
    """What refuses `name`'s bad value (the wechatpay key: its provider's loader)."""
    if name == "GATE_WECHATPAY_APIV3_KEY":
        return lambda env: load_wechatpay_settings(_settings(env).environ)
    return USES[name].read


def _env_for(env: dict[str, str], name: str) -> dict[str, str]:
    given = {**env, **USES[name].extra}
    given.pop(name, None)
    return given


def _write(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name.lower()
    path.write_text(content)
    return path


def test_every_secret_has_a_use_here() -> None:
    assert set(USES) == set(SECRET_NAMES)


# A variable whose name says "secret" but holds none: public key ids, paths.
NOT_SECRETS = frozenset(("GATE_SANDBOX_PUBLIC_URL",))
_SECRET_LOOKING = re.compile(r"GATE_[A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|_KEY)\b")


def test_every_secret_variable_the_code_reads_is_a_secret_name() -> None:
    """A secret added later is listed in SECRET_NAMES, so it gets _FILE too."""
    found: set[str] = set()
    for path in (ROOT / "gate").rglob("*.py"):
        found.update(_SECRET_LOOKING.findall(path.read_text()))
    assert found - NOT_SECRETS - set(SECRET_NAMES) == set()


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_the_file_content_reaches_what_uses_the_secret(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    use = USES[name]
    given = _env_for(env, name)
    # As `echo secret > file` writes it: the one trailing newline is not the secret's.
    given[name + "_FILE"] = str(_write(tmp_path, name, use.good + "\n"))
    expected = use.good if use.expect is None else use.expect
    assert use.read(given) == expected
    # Unset and empty are the same: NAME="" besides NAME_FILE is not "both set".
    assert use.read({**given, name: ""}) == expected


@pytest.mark.parametrize("name", [n for n in SECRET_NAMES if USES[n].bad is not None])
def test_a_bad_secret_from_a_file_is_refused_without_printing_it(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    use = USES[name]
    assert use.bad is not None
    given = _env_for(env, name)
    given[name + "_FILE"] = str(_write(tmp_path, name, use.bad + "\n"))
    with pytest.raises(SettingsError) as refused:
        _bad_value_check(name)(given)
    message = str(refused.value)
    assert use.error in message
    assert use.bad not in message
    # The URLs' passwords are the secret part of them.
    for word in ("sentinel-db-password", "sentinel-redis-password"):
        assert word not in message


@pytest.mark.parametrize("name", [n for n in SECRET_NAMES if not n.endswith("_URL")])
def test_a_secret_from_a_file_is_redacted_from_the_logs(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    given = _env_for(env, name)
    given[name + "_FILE"] = str(_write(tmp_path, name, USES[name].good + "\n"))
    # What the operations area hands the log redactor (gate/base/logs.py).
    assert USES[name].good in _secrets(load_settings(given))


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_a_secret_set_both_ways_stops_start_up(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    given = _env_for(env, name)
    given[name] = USES[name].good
    given[name + "_FILE"] = str(_write(tmp_path, name, "other-value-in-the-file-0123456789"))
    out = serve_once(given)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{name} and {name}_FILE are both set" in out.stderr
    assert "Traceback" not in out.stderr
    assert "other-value-in-the-file" not in out.stdout + out.stderr


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_an_unreadable_secret_file_stops_start_up_naming_the_variable(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    given = _env_for(env, name)
    given[name + "_FILE"] = str(tmp_path / "missing")
    out = serve_once(given)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{name}_FILE: cannot read" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, "is not a regular file"),  # a directory
        (b"\xff\xfe-not-text", "is not UTF-8 text"),
        (b"x" * (SECRET_FILE_MAX_BYTES + 1), f"is over {SECRET_FILE_MAX_BYTES} bytes"),
    ],
)
def test_a_secret_file_that_is_no_secret_is_refused(
    env: dict[str, str], tmp_path: Path, content: bytes | None, error: str
) -> None:
    path = tmp_path / "secret"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    given = _env_for(env, "GATE_JWT_SECRET")
    given["GATE_JWT_SECRET_FILE"] = str(path)
    with pytest.raises(SettingsError, match=f"GATE_JWT_SECRET_FILE: .* {error}"):
        load_settings(given)


def test_only_one_trailing_newline_is_stripped(env: dict[str, str], tmp_path: Path) -> None:
    given = _env_for(env, "GATE_ADMIN_TOKEN")
    for written, read in (
        ("admin-token-0123456789abcdef0123\r\n", "admin-token-0123456789abcdef0123"),
        ("admin-token-0123456789abcdef0123", "admin-token-0123456789abcdef0123"),
        ("admin-token-0123456789abcdef0123 \n\n", "admin-token-0123456789abcdef0123 \n"),
    ):
        given["GATE_ADMIN_TOKEN_FILE"] = str(_write(tmp_path, "token", written))
        assert load_settings(given).environ["GATE_ADMIN_TOKEN"] == read


@pytest.mark.slow
async def test_a_gate_with_its_secrets_in_files_serves(env: dict[str, str], tmp_path: Path) -> None:
    given = dict(env)
    for name, value in (
        ("GATE_JWT_SECRET", JWT_SECRET),
        ("GATE_ADMIN_TOKEN", ADMIN_TOKEN),
        ("GATE_WEBHOOK_SECRET", WEBHOOK_SECRET),
        ("GATE_ADMISSION_SECRET", ADMISSION_SECRET),
        ("GATE_MYSQL_URL", env["GATE_MYSQL_URL"]),
        ("GATE_REDIS_URL", env["GATE_REDIS_URL"]),
    ):
        path = _write(tmp_path, name, value + "\n")
        # Readable by the owner only, as a mounted secret is.
        os.chmod(path, 0o400)
        del given[name]
        given[name + "_FILE"] = str(path)
    gate = GateProcess(given, background=False)
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        deal_id = await create_deal(client, stock=5)
        assert (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).status_code == 200
        r = await reserve(client, deal_id, 9_800_001, f"secret-files-{deal_id}")
        assert r.status_code == 201, r.text
    finally:
        await client.close()
        assert gate.stop() == 0, gate.output()[-2000:]
