"""API keys for tests: the secrets, their SHA-256 as the config holds it, a key, its header."""

from __future__ import annotations

import hashlib

from relay.config import KeyConfig

SECRET = "sk-alpha-0123456789-secret"
OTHER_SECRET = "sk-beta-9876543210-secret"
ADMIN = "adm-4242-very-secret"


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key(key_id: str = "alpha", secret: str = SECRET, **limits) -> KeyConfig:
    return KeyConfig(id=key_id, sha256=sha(secret), **limits)


def bearer(secret: str = SECRET) -> dict:
    return {"Authorization": f"Bearer {secret}"}
