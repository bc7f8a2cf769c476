"""Standard Webhooks signatures (https://www.standardwebhooks.com/), on raw bytes.

The signed content is `{webhook-id}.{webhook-timestamp}.{raw body}`; the signature
header lists space-separated `v1,<base64 HMAC-SHA256>` entries, any of which may
match any configured key (rotation: the provider signs with the new key and the
old one for a while; the gate accepts either of several secrets).

Why not the `standardwebhooks` package's `verify`: it decodes the body as UTF-8
before signing it (a non-UTF-8 body raises an error other than its verification
error), accepts fractional and exponent timestamps and floors them, and raises a
bare ValueError on a malformed signature entry. This module works on the bytes as
received, accepts only an integer timestamp within ±300 s, bounds every header and
compares in constant time. tests/payments/test_payments_signing.py checks that the
package's signatures verify here and ours there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence

from gate.base.settings import Secret, SettingsError

# The HMAC part is shared with the outbound webhooks (gate/base/standard_webhooks.py);
# sign and sign_headers are named here too for the sandbox and the tests.
from gate.base.standard_webhooks import parse_secret, sign, sign_headers, signed_content

__all__ = [
    "HEADERS",
    "WebhookRejected",
    "decode_secret",
    "decode_secrets",
    "sign",
    "sign_headers",
    "signed_content",
    "verify",
]

TOLERANCE_SECONDS = 300
# The request headers a Standard Webhooks delivery is verified with (lower-case).
HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
SIGNATURE_ENTRIES_MAX = 16
SIGNATURE_HEADER_MAX = 2048
# No dots: the signed content joins id, timestamp and body with dots, so an id with a
# dot could shift bytes between the id and the timestamp under the same signature.
MSG_ID_RE = re.compile(r"[\x21-\x2d\x2f-\x7e]{1,191}")
TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")


class WebhookRejected(Exception):
    """The request is not a genuine, fresh webhook from the provider."""


def decode_secret(secret: str) -> bytes:
    if not secret.startswith("whsec_"):
        raise SettingsError(
            "webhook secrets (GATE_WEBHOOK_SECRET, GATE_SANDBOX_WEBHOOK_SECRET) must look like"
            " whsec_<base64>"
        )
    try:
        key = parse_secret(secret)
    except ValueError:
        raise SettingsError(
            "a webhook secret (GATE_WEBHOOK_SECRET, GATE_SANDBOX_WEBHOOK_SECRET) is not valid"
            " base64 after whsec_"
        ) from None
    if len(key) < 16:
        raise SettingsError("a webhook secret must decode to at least 16 bytes")
    return key


def decode_secrets(secrets: Sequence[Secret]) -> tuple[bytes, ...]:
    return tuple(decode_secret(s.reveal()) for s in secrets)


def verify(keys: Sequence[bytes], headers: Mapping[str, str], body: bytes, now: float) -> str:
    """Check a webhook; returns its webhook-id. Raises WebhookRejected."""
    msg_id = headers.get("webhook-id") or ""
    timestamp = headers.get("webhook-timestamp") or ""
    signature = headers.get("webhook-signature") or ""
    if not MSG_ID_RE.fullmatch(msg_id):
        raise WebhookRejected("missing or malformed webhook-id")
    if not TIMESTAMP_RE.fullmatch(timestamp):
        raise WebhookRejected("missing or malformed webhook-timestamp")
    if abs(now - int(timestamp)) > TOLERANCE_SECONDS:
        raise WebhookRejected("webhook-timestamp outside the ±300 s window")
    if not signature or len(signature) > SIGNATURE_HEADER_MAX:
        raise WebhookRejected("missing or oversized webhook-signature")
    offered: list[bytes] = []
    for entry in signature.split(" ")[:SIGNATURE_ENTRIES_MAX]:
        version, _, value = entry.partition(",")
        if version != "v1" or not value:
            continue
        try:
            offered.append(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError):
            continue
    if not offered:
        raise WebhookRejected("no v1 signature")
    content = signed_content(msg_id, timestamp, body)
    matched = False
    for key in keys:
        expected = hmac.new(key, content, hashlib.sha256).digest()
        for candidate in offered:
            # Every comparison runs: the time taken does not depend on which matched.
            matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise WebhookRejected("no signature matches")
    return msg_id
