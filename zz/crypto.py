# zz/crypto.py - SHA-256, HMAC-SHA-256 and Ed25519 primitives for the ZZ wire format.
# One small module so wire.py, keys.py and the client agree on exactly one way to sign and MAC.
from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

DIGEST_LEN = 32
MAC_LEN = 32
SIG_LEN = 64
KEY_LEN = 32
NULL_DIGEST = bytes(DIGEST_LEN)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def hmac_sha256(key: bytes, data: bytes) -> bytes:
    if len(key) != KEY_LEN:
        raise ValueError(f"MAC key must be {KEY_LEN} bytes, got {len(key)}")
    return hmac.new(key, data, hashlib.sha256).digest()


def ct_equal(a: bytes, b: bytes) -> bool:
    # Constant time so that a forger cannot learn a MAC byte by byte from timing.
    return hmac.compare_digest(a, b)


class SigningKey:
    """An Ed25519 private key built from its 32-byte RFC 8032 seed (the key file format)."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != KEY_LEN:
            raise ValueError(f"Ed25519 seed must be {KEY_LEN} bytes, got {len(seed)}")
        self.seed = bytes(seed)
        self._key = Ed25519PrivateKey.from_private_bytes(self.seed)
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:  # never print the seed
        return f"SigningKey(public={self.public.hex()})"


def verify_signature(public: bytes, data: bytes, signature: bytes) -> bool:
    if len(public) != KEY_LEN or len(signature) != SIG_LEN:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True
