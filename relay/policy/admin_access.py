"""Who may do what beyond inference: the relay's own admin endpoints and the upstream's
mutating ones.

Admin requests are `/metrics`, `/api/*`, and llama-server's endpoints that change the server
for everyone or read other callers' data: `POST /props`, `POST /lora-adapters`, `/slots`
(the list shows every slot's prompt; `POST /slots/<id>?action=save|restore|erase`), the
router's model management (`/models` other than GET: load, unload, add, delete) and the
experimental `/cors-proxy`. Who is an admin:

- an admin key is configured: whoever presents it;
- API keys but no admin key: a peer on the loopback interface (the operator's own box);
- no keys at all (the edge default): everyone, as before.

Paths are matched in their normalised form (`paths.normalize`): what the upstream routes on.
"""

from __future__ import annotations

import ipaddress

from relay.policy.keys import Auth

RELAY_ADMIN_PREFIX = "/api/"
RELAY_METRICS = "/metrics"


def is_relay_admin(path: str) -> bool:
    """The relay's own admin endpoints (answered by the relay, never forwarded)."""
    return path == RELAY_METRICS or path.startswith(RELAY_ADMIN_PREFIX)


def is_upstream_admin(method: bytes, path: str) -> bool:
    """An upstream endpoint only an admin may reach."""
    if path in ("/props", "/lora-adapters"):
        return method != b"GET" and method != b"HEAD"
    if path == "/slots" or path.startswith("/slots/"):
        return True
    if path == "/models" or path.startswith("/models/"):
        return method != b"GET" and method != b"HEAD"
    return path == "/cors-proxy" or path.startswith("/cors-proxy/")


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is on the loopback interface (IPv4-mapped IPv6 included)."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def admin_refusal(auth: Auth, headers, peer_host: str | None) -> tuple[str, str] | None:
    """None when the caller may use admin endpoints, else (error code, message)."""
    if auth.admin is not None:
        if auth.admin_ok(headers):
            return None
        return "invalid_api_key", "admin key required"
    if not auth.enabled or is_loopback(peer_host):
        return None
    return "forbidden", (
        "admin endpoints are open to loopback peers only when no admin_key_sha256 is configured"
    )
