"""Endpoint signing secrets: made here, shown once, kept sealed in the database.

    new endpoint / rotation ──> whsec_<base64 of 32 random bytes> ──> the answer (once)
                                     └──> seal(endpoint id, secret) ──> webhook_endpoints
    each delivery ──> open(endpoint id, sealed) ──> the HMAC key(s) ──> signature

Why sealed, not plain: the gate must sign, so it must be able to read the secret (a
hash would not do). Kept in plain text, anyone who reads the database (a backup, a
replica, a read-only account, a dump attached to a ticket) could forge webhooks to
every shop's backend. Sealed with AES-256-GCM under a key derived (HKDF-SHA256) from
GATE_WEBHOOK_ENCRYPTION_KEY, a secret that lives in the gate's environment only,
reading the database is no longer enough; reading both still is (the gate itself
must be able to sign). The endpoint's id is the additional data, so a sealed secret
moved to another row does not open.

GATE_WEBHOOK_ENCRYPTION_KEY may list several keys, newest first: the first seals, any
opens (each sealed value names its key by an 8-hex-digit id), so the key can be
changed without losing the endpoints: add the new key in front, then rotate each
endpoint's secret (`gate webhooks rotate`), then drop the old key.

    sealed = "v1." <key id> "." <base64url nonce> "." <base64url ciphertext+tag>
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gate.base.settings import Secret
from gate.base.standard_webhooks import new_secret, parse_secret

# 32 bytes: within the 24–64 the contract allows, as Svix and Stripe use.
SECRET_KEY_BYTES = 32
SEALED_VERSION = "v1"
_INFO = b"gate webhook endpoint secrets v1"


class VaultError(Exception):
    """A sealed secret that no configured key opens (or that is malformed)."""


class NoKey(Exception):
    """No GATE_WEBHOOK_ENCRYPTION_KEY: secrets can neither be sealed nor opened."""


def _derive(material: str) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO)
    return hkdf.derive(material.encode("utf-8"))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Vault:
    def __init__(self, keys: Sequence[Secret]) -> None:
        self._keys: list[tuple[str, AESGCM]] = []
        for secret in keys:
            derived = _derive(secret.reveal())
            key_id = hashlib.sha256(derived).hexdigest()[:8]
            self._keys.append((key_id, AESGCM(derived)))

    @property
    def ready(self) -> bool:
        return bool(self._keys)

    @staticmethod
    def new_secret() -> str:
        return new_secret(SECRET_KEY_BYTES)

    def seal(self, endpoint_id: str, secret: str) -> str:
        if not self._keys:
            raise NoKey
        key_id, aead = self._keys[0]
        nonce = os.urandom(12)
        sealed = aead.encrypt(nonce, secret.encode("ascii"), endpoint_id.encode("ascii"))
        return f"{SEALED_VERSION}.{key_id}.{_b64(nonce)}.{_b64(sealed)}"

    def open(self, endpoint_id: str, sealed: str) -> str:
        if not self._keys:
            raise NoKey
        parts = sealed.split(".")
        if len(parts) != 4 or parts[0] != SEALED_VERSION:
            raise VaultError("a sealed webhook secret is malformed")
        _, key_id, nonce, data = parts
        for kid, aead in self._keys:
            if kid != key_id:
                continue
            try:
                plain = aead.decrypt(_unb64(nonce), _unb64(data), endpoint_id.encode("ascii"))
            except (InvalidTag, binascii.Error, ValueError):
                raise VaultError(
                    f"webhook endpoint {endpoint_id}: its secret does not open with key {key_id}"
                ) from None
            return plain.decode("ascii")
        raise VaultError(
            f"webhook endpoint {endpoint_id}: its secret was sealed with key {key_id}, which"
            " GATE_WEBHOOK_ENCRYPTION_KEY does not list"
        )

    def signing_key(self, endpoint_id: str, sealed: str) -> bytes:
        try:
            return parse_secret(self.open(endpoint_id, sealed))
        except ValueError as exc:
            raise VaultError(f"webhook endpoint {endpoint_id}: its secret is {exc}") from None
