"""Who may do what beyond inference: the relay's own admin endpoints and the upstream's
mutating ones.

Admin requests are `/metrics`, `/api/*`, and llama-server's endpoints that change the server
for everyone or read other callers' data: `POST /props`, `POST /lora-adapters`, `/slots`
(the list shows every slot's prompt; `POST /slots/<id>?action=save|restore|erase`), the
router's model management (`/models` other than GET: load, unload, add, delete) and the
experimental `/cors-proxy`. Who is an admin:

- an admin key is configured: whoever presents it;
- API keys but no admin key: a peer on the loopback interface (the operator's own box), and
  only when the request names this relay (`names_relay`: no DNS-rebinding page) and comes from
  no browser page of another origin (`cross_origin`);
- no keys at all (the edge default): everyone, as before.

Whatever the mode, a mutating admin request (any method but GET and HEAD) from a browser page
of another origin is refused (no cross-site request forgery): such a page can send a "simple"
POST without a CORS preflight, and with the loopback trust or no keys it needs no credential.
Configured CORS origins do not count as the relay's own: they may call inference, not change
the server. Each of these refusals is 403 `forbidden`; requests with no `Origin` and no
`Sec-Fetch-Site` (curl, SDKs) are judged as before. The exact rule: docs/security.md.

Paths are matched in their normalised form (`http.request_path.normalize`): what the
upstream routes on. A refusal is a `Refusal`: the error code and the message answered.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

from relay.errors import Code
from relay.http.fields import HeaderPairs, lower_names, values_of
from relay.policy.keys import Auth

RELAY_ADMIN_PREFIX = "/api/"
RELAY_METRICS = "/metrics"
# What a browser says of the page that made a request; "none": the user typed or bookmarked it.
OWN_SITE = (b"same-origin", b"none")
DEFAULT_PORT = {"http": ":80", "https": ":443"}
# Host: `[IPv6]` or a name / IPv4 address, then an optional port (compared lower case).
_HOST = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9][a-z0-9.-]*))(?::[0-9]{1,5})?")
_ORIGIN = re.compile(r"(https?)://(\[[0-9a-f:.]+\](?::[0-9]{1,5})?|[a-z0-9.:-]+)")
_LOCALHOST = re.compile(r"(?:[a-z0-9-]+\.)*localhost")

NOT_LOOPBACK = (
    "admin endpoints are open to loopback peers only when no admin_key_sha256 is configured"
)
NOT_OUR_HOST = (
    "admin endpoints trust a loopback peer only with a Host naming this relay"
    " (localhost, *.localhost, a loopback address or [server].host)"
)
OTHER_ORIGIN = "admin endpoints refuse requests from a browser page of another origin"


class Refusal(NamedTuple):
    """An admin request refused: the error code (`relay.errors`) and the message; a tuple,
    so `RelayError(*refusal)` answers it."""

    code: Code
    message: str


_FAR_PEER = Refusal(Code.FORBIDDEN, NOT_LOOPBACK)
_NOT_OUR_NAME = Refusal(Code.FORBIDDEN, NOT_OUR_HOST)
_CROSS_SITE = Refusal(Code.FORBIDDEN, OTHER_ORIGIN)
_NO_ADMIN_KEY = Refusal(Code.INVALID_API_KEY, "admin key required")


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


def is_admin(method: bytes, path: str) -> bool:
    """Whether only an admin may make this request (the relay's admin or the upstream's)."""
    return is_relay_admin(path) or is_upstream_admin(method, path)


def is_mutating(method: bytes) -> bool:
    """Whether an admin request may change the server: any method but GET and HEAD."""
    return method != b"GET" and method != b"HEAD"


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


def beyond_loopback(listen_host: str) -> bool:
    """Whether `[server].host` lets other machines in: anything but a loopback address
    (`127.0.0.0/8`, `::1`) or `localhost` (a wildcard, an interface's address, another name)."""
    host = listen_host.strip().lower()
    return host != "localhost" and not is_loopback(host.strip("[]"))


# What a relay open to the network gives anyone who can reach it (`open_to_network`).
OPEN_EXPOSES = (
    "every route with no key asked: inference, the upstream's own routes",
    "/slots: every caller's prompts, and POST /slots to save, restore or erase them",
    "POST /props, /lora-adapters and the router's model loading: the upstream's settings",
    "/metrics, /api/* and the operator page /ui: the relay's figures and recent requests",
)


def open_to_network(auth: Auth, listen_host: str) -> bool:
    """Whether everything is open to other machines: the relay listens beyond loopback
    with no API key and no admin key (`OPEN_EXPOSES` says what then is)."""
    return auth.admin is None and not auth.enabled and beyond_loopback(listen_host)


def _listen_name(listen_host: str) -> str | ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`[server].host` as a Host may name it: an address, a lower-case name, or None for a
    wildcard (`0.0.0.0`, `::`, empty), which names no one host."""
    if not listen_host:
        return None
    try:
        ip = ipaddress.ip_address(listen_host)
    except ValueError:
        return listen_host.lower()
    return None if ip.is_unspecified else ip


def names_relay(host: bytes | None, listen_host: str) -> bool:
    """Whether a `Host` value names this relay, so that no DNS-rebinding page sent it: a
    loopback name (`localhost`, `*.localhost`), a loopback address (`127.0.0.0/8`, `[::1]`,
    `[::ffff:127.x.y.z]`), or `[server].host` (`listen_host`) unless it is a wildcard; with any
    port or none (the name is what a rebinding page forges; another port reaches the relay only
    through a forwarder on the box, `ssh -L`). None (no Host, which only HTTP/1.0 allows and no
    browser omits) names it too."""
    if host is None:
        return True
    m = _HOST.fullmatch(host.decode("latin-1").strip().lower())
    if m is None:
        return False
    v6, name = m.groups()
    own = _listen_name(listen_host)
    if v6 is not None:
        try:
            ip6 = ipaddress.IPv6Address(v6)
        except ValueError:
            return False
        return is_loopback(str(ip6)) or ip6 == own
    if _LOCALHOST.fullmatch(name):
        return True
    try:
        ip4 = ipaddress.IPv4Address(name)
    except ValueError:
        return name == own
    return ip4.is_loopback or ip4 == own


def same_origin(origin: bytes, host: bytes) -> bool:
    """Whether an `Origin` is the origin a request with this `Host` was sent to: the same
    host and port (a scheme's default port whether written or not), `http` or `https`.
    `null` (a sandboxed frame, a file), an origin with a path or a user part: never the
    relay's."""
    m = _ORIGIN.fullmatch(origin.decode("latin-1").strip().lower())
    if m is None:
        return False
    scheme, authority = m.groups()
    default = DEFAULT_PORT[scheme]
    named = host.decode("latin-1").strip().lower()
    return authority.removesuffix(default) == named.removesuffix(default)


def cross_origin(headers: HeaderPairs) -> bool:
    """Whether a browser page of another origin sent the request: a `Sec-Fetch-Site` other
    than `same-origin` or `none` (`same-site` is another port or subdomain: another origin),
    or an `Origin` that is not the one the `Host` names. A request with neither (curl, SDKs,
    a page's own GET that needs no `Origin`) is not; a repeated header is."""
    lows = lower_names(headers)
    sites = values_of(headers, lows, b"sec-fetch-site")
    if len(sites) > 1 or (sites and sites[0].strip().lower() not in OWN_SITE):
        return True
    origins = values_of(headers, lows, b"origin")
    if not origins:
        return False
    hosts = values_of(headers, lows, b"host")
    return len(origins) > 1 or len(hosts) != 1 or not same_origin(origins[0], hosts[0])


def loopback_refusal(
    auth: Auth, headers: HeaderPairs, peer_host: str | None, listen_host: str
) -> Refusal | None:
    """The admin rule's network part (keys without an admin key): a loopback peer and a Host
    naming this relay. None when it holds (or does not apply), else the refusal."""
    if auth.admin is not None or not auth.enabled:
        return None
    if not is_loopback(peer_host):
        return _FAR_PEER
    lows = lower_names(headers)
    hosts = values_of(headers, lows, b"host")
    if len(hosts) > 1 or not names_relay(hosts[0] if hosts else None, listen_host):
        return _NOT_OUR_NAME
    return None


def admin_refusal(
    auth: Auth, method: bytes, headers: HeaderPairs, peer_host: str | None, listen_host: str
) -> Refusal | None:
    """None when the caller may make this admin request, else the refusal.
    `listen_host`: `[server].host`, a name a Host may give the relay.

    A mutating request from a page of another origin is refused whatever the credentials.
    The loopback trust is for the operator's own pages: under it, a page of another origin
    is refused whatever the method."""
    if is_mutating(method) and cross_origin(headers):
        return _CROSS_SITE
    if auth.admin is not None:
        if auth.admin_ok(headers):
            return None
        return _NO_ADMIN_KEY
    if not auth.enabled:
        return None
    refused = loopback_refusal(auth, headers, peer_host, listen_host)
    if refused is not None:
        return refused
    if cross_origin(headers):
        return _CROSS_SITE
    return None
