"""What the Alipay and WeChat Pay v3 adapters share besides the HTTP exchange
(gate/payments/providers/provider_http.py): RSA keys read once from files,
SHA256withRSA (PKCS#1 v1.5) signing and verification with `cryptography`, exact
yuan <-> fen conversion, and the providers' idempotency keys.

Why `cryptography` directly and not `python-alipay-sdk` / `wechatpayv3`: both SDKs
make blocking `requests` calls from inside their API methods (the gate's provider
calls are async, bounded and retried by the gate, with the idempotency keys the gate
chooses), and both would bring their own retry and time-out behaviour. The part we
need from them — RSA signatures and AES-GCM — is a few calls into `cryptography`,
which they use underneath as well.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from decimal import Decimal, InvalidOperation
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from gate.base.settings import SettingsError
from gate.payments.provider import AMOUNT_MAX

KEY_FILE_MAX_BYTES = 65_536
SIGNATURE_B64_MAX = 2048
# Both providers take idempotency keys (out_request_no, out_refund_no) of at most 64
# characters.
PROVIDER_KEY_MAX = 64


def read_private_key(name: str, path: str) -> rsa.RSAPrivateKey:
    """A PEM RSA private key (PKCS#8 or PKCS#1) of at least 2048 bits; `name` is the
    variable that named the file, for the start-up error."""
    data = _read(name, path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise SettingsError(f"{name}: {path} is not an unencrypted PEM private key") from None
    if not isinstance(key, rsa.RSAPrivateKey) or key.key_size < 2048:
        raise SettingsError(f"{name}: {path} must hold an RSA key of at least 2048 bits")
    return key


def read_public_key(name: str, path: str) -> rsa.RSAPublicKey:
    """A PEM RSA public key, a PEM certificate (its key), or the bare base64 body
    Alipay's console shows (no PEM armour)."""
    data = _read(name, path)
    key: object
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            from cryptography import x509

            key = x509.load_pem_x509_certificate(data).public_key()
        elif b"-----BEGIN" in data:
            key = serialization.load_pem_public_key(data)
        else:
            key = serialization.load_der_public_key(base64.b64decode(b"".join(data.split())))
    except (ValueError, TypeError, binascii.Error):
        raise SettingsError(f"{name}: {path} is not an RSA public key or certificate") from None
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 2048:
        raise SettingsError(f"{name}: {path} must hold an RSA key of at least 2048 bits")
    return key


def certificate_serial(name: str, path: str) -> str | None:
    """The serial number (upper-case hex, as WeChat Pay writes it in Wechatpay-Serial)
    of the PEM certificate in `path`; None when the file holds a bare public key."""
    data = _read(name, path)
    if b"-----BEGIN CERTIFICATE-----" not in data:
        return None
    from cryptography import x509

    try:
        return format(x509.load_pem_x509_certificate(data).serial_number, "X")
    except ValueError:
        raise SettingsError(f"{name}: {path} is not a PEM certificate") from None


def _read(name: str, path: str) -> bytes:
    try:
        with Path(path).open("rb") as f:
            data = f.read(KEY_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise SettingsError(f"{name}: cannot read {path}: {exc.strerror}") from None
    if len(data) > KEY_FILE_MAX_BYTES:
        raise SettingsError(f"{name}: {path} is larger than {KEY_FILE_MAX_BYTES} bytes")
    return data


def sign_sha256_rsa(key: rsa.RSAPrivateKey, message: bytes) -> str:
    """SHA256withRSA (RSASSA-PKCS1-v1_5), base64: what both providers call RSA2 /
    SHA256-RSA2048."""
    return base64.b64encode(key.sign(message, padding.PKCS1v15(), hashes.SHA256())).decode()


def verify_sha256_rsa(key: rsa.RSAPublicKey, message: bytes, signature_b64: str) -> bool:
    if not signature_b64 or len(signature_b64) > SIGNATURE_B64_MAX:
        return False
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    try:
        key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


def yuan_to_fen(text: str) -> int:
    """'88.88' -> 8888, exactly (Decimal, never float); at most two decimals, no sign,
    no exponent. Raises ValueError for anything else."""
    if not text or len(text) > 24 or not all(c.isdigit() or c == "." for c in text):
        raise ValueError(f"not a yuan amount: {text!r}")
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"not a yuan amount: {text!r}") from None
    fen = value * 100
    if fen != fen.to_integral_value() or not 0 <= fen <= AMOUNT_MAX:
        raise ValueError(f"not a whole number of fen: {text!r}")
    return int(fen)


def fen_to_yuan(fen: int) -> str:
    if not 0 <= fen <= AMOUNT_MAX:
        raise ValueError(f"amount out of range: {fen}")
    return f"{fen // 100}.{fen % 100:02d}"


def provider_key(key: str) -> str:
    """The gate's idempotency key as the provider's out_request_no / out_refund_no:
    unchanged when it fits (64 characters of [0-9A-Za-z_-]), else a stable digest."""
    if len(key) <= PROVIDER_KEY_MAX and all(c.isalnum() or c in "_-" for c in key):
        return key
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:48]
