"""Standard Webhooks signatures (https://www.standardwebhooks.com/): the HMAC part
both directions share.

    signed content  = "{webhook-id}.{webhook-timestamp}.{raw body}"
    one signature   = "v1," + base64(HMAC-SHA256(key, signed content))
    the header      = the signatures of every key signing, space-separated
    a secret        = "whsec_" + base64(key)

Inbound payment callbacks are verified with it (gate/payments/signing.py, which adds
the checks a receiver makes); outbound webhooks to a shop are signed with it
(gate/webhooks/). One primitive, low in the layers, so neither area imports the other.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"


def signed_content(msg_id: str, timestamp: str, body: bytes) -> bytes:
    return msg_id.encode() + b"." + timestamp.encode() + b"." + body


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(key, signed_content(msg_id, str(timestamp), body), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def sign_headers(keys: Sequence[bytes], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers of one delivery, signed by every key (the first is the newest)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(k, msg_id, timestamp, body) for k in keys),
    }


def parse_secret(secret: str) -> bytes:
    """The key of a `whsec_<base64>` secret; ValueError (saying why, never the
    secret) when it is not one."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("not of the form whsec_<base64>")
    body = secret[len(SECRET_PREFIX) :]
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64 after whsec_") from None


def new_secret(key_bytes: int = 32) -> str:
    """A fresh `whsec_` secret of `key_bytes` random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(key_bytes)).decode()
