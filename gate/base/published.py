"""Secret values that are public because the repository publishes them.

    a secret's value (each entry of a list; a URL's password)
      -> a development value below?            "the public development value"
      -> starts with CHANGE-ME (any case), or one of EXAMPLE_VALUES
         (a whsec_ secret: its key bytes too)?  "a placeholder of the examples"
      -> else None: a value of the operator's own

Outside GATE_ENV=dev either answer stops start-up (gate/base/settings.py), naming
the variable, never the value: anyone can read these values in a clone, so a gate
running with one would let anyone mint buyer tokens, act as admin or forge payment
callbacks.

EXAMPLE_VALUES is the one list of the secret values the repository's example
files ship (deploy/, the docker-compose files, docs/, README.md, loadtest/README.md).
tests/base/test_published_values.py reads those files and fails on a secret value
found there that this module does not refuse, so an example added later without a
CHANGE-ME prefix must be listed here.
"""

from __future__ import annotations

import base64
import binascii

DEV_JWT_SECRET = "gate-dev-jwt-secret-not-for-production-000000"
DEV_ADMIN_TOKEN = "gate-dev-admin-token"
# The waiting room's admission tokens (gate/room/tokens.py) have a key of their own.
DEV_ADMISSION_SECRET = "gate-dev-admission-secret-not-for-production-0"
# base64 of "gate-dev-webhook-secret-0123456789"
DEV_WEBHOOK_SECRET = "whsec_Z2F0ZS1kZXYtd2ViaG9vay1zZWNyZXQtMDEyMzQ1Njc4OQ=="
# Published in docker-compose.dev.yml, so public too: the sandbox's API key and the
# passwords of the development database and Redis. Refused outside GATE_ENV=dev.
DEV_SANDBOX_API_KEY = "gate-dev-sandbox-api-key"
DEV_PASSWORDS = frozenset(("gate-dev-app-password", "gate-dev-root", "gate-dev-redis"))
DEV_VALUES = frozenset(
    (
        DEV_JWT_SECRET,
        DEV_ADMIN_TOKEN,
        DEV_ADMISSION_SECRET,
        DEV_WEBHOOK_SECRET,
        DEV_SANDBOX_API_KEY,
        *DEV_PASSWORDS,
    )
)
DEV_ONLY = (
    "the public development value; set a secret of your own"
    " (the built-in one is accepted only with GATE_ENV=dev)"
)

# Every example value starts with it (compared in any case).
PLACEHOLDER_PREFIX = "change-me"
# The example values that do not: a webhook secret must be whsec_<base64> (its key
# bytes, base64 of "CHANGE-ME fake webhook secret", are caught by the prefix too),
# and the rotation runbook's spellings.
EXAMPLE_VALUES = frozenset(
    (
        "whsec_Q0hBTkdFLU1FIGZha2Ugd2ViaG9vayBzZWNyZXQ=",
        "whsec_OLD",
        "whsec_NEW",
    )
)
PLACEHOLDER = (
    "a placeholder published in the repository's examples; set a secret of your own"
    " (e.g. openssl rand -hex 32)"
)


def webhook_key(secret: str) -> bytes | None:
    """The key bytes of a whsec_<base64> secret, padded or not (the way the signer
    decodes it), or None if it is not one. Secrets are compared as these bytes: the
    dev secret written without its "==" is still the same, public, key."""
    if not secret.startswith("whsec_"):
        return None
    body = secret[len("whsec_") :]
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None


DEV_WEBHOOK_KEY = webhook_key(DEV_WEBHOOK_SECRET)
_EXAMPLE_KEYS = frozenset(k for k in map(webhook_key, EXAMPLE_VALUES) if k is not None)


def published_reason(value: str) -> str | None:
    """Why `value` (one secret, whitespace around it ignored) is public: DEV_ONLY or
    PLACEHOLDER; None for a value of the operator's own."""
    entry = value.strip()
    if not entry:
        return None
    key = webhook_key(entry)
    if entry in DEV_VALUES or (key is not None and key == DEV_WEBHOOK_KEY):
        return DEV_ONLY
    if entry.lower().startswith(PLACEHOLDER_PREFIX) or entry in EXAMPLE_VALUES:
        return PLACEHOLDER
    if key is not None and (
        key in _EXAMPLE_KEYS
        or key[: len(PLACEHOLDER_PREFIX)].lower() == PLACEHOLDER_PREFIX.encode()
    ):
        return PLACEHOLDER
    return None
