"""API keys: the caller's secret -> key id, compared in constant time. Secrets are never kept."""

from __future__ import annotations

import hashlib
import hmac

from relay.config import KeyConfig
from relay.http.fields import HeaderPairs, get


def presented_secret(headers: HeaderPairs) -> bytes | None:
    """`Authorization: Bearer <secret>` or `x-api-key: <secret>`."""
    value = get(headers, b"authorization")
    if value is not None:
        scheme, _, secret = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and secret.strip():
            return secret.strip()
        return None
    value = get(headers, b"x-api-key")
    return value.strip() if value and value.strip() else None


class Auth:
    def __init__(self, keys: list[KeyConfig], admin_sha256: str | None) -> None:
        self.keys = [(k.id, bytes.fromhex(k.sha256)) for k in keys]
        self.admin = bytes.fromhex(admin_sha256) if admin_sha256 else None

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, headers: HeaderPairs) -> str | None:
        """The id of the key the caller presented, or None. Every key is compared, always."""
        secret = presented_secret(headers)
        digest = hashlib.sha256(secret or b"").digest()
        found = None
        for key_id, want in self.keys:
            if hmac.compare_digest(digest, want) and secret is not None:
                found = key_id
        return found

    def admin_ok(self, headers: HeaderPairs) -> bool:
        """Whether /api/* and /metrics may be read: open when no admin key is configured."""
        if self.admin is None:
            return True
        secret = presented_secret(headers)
        digest = hashlib.sha256(secret or b"").digest()
        return hmac.compare_digest(digest, self.admin) and secret is not None
