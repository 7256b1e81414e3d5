"""What an `[[upstream]]` adds to every request it is sent: static headers and its own key.

`headers = { "OpenAI-Organization" = "org-x" }` is for what a provider needs that is not a
secret. Anything that looks like a credential is refused at start: secrets come only from
the environment (`auth_header` + `auth_value_env`), so a config file never holds one.

When an upstream has its own key, none of the client's credentials go to it (the relay's
key is the one the provider bills): `CLIENT_CREDENTIALS` are dropped from what crosses.

Every upstream is asked for an unencoded body (`Accept-Encoding: identity`): the relay reads
what passes (content events, `usage`), which a hosted API would otherwise gzip when the client
says it accepts that (the openai client does), leaving the row without tokens and the hold
before the first content event waiting for an event it cannot see.
"""

from __future__ import annotations

import re

# Header names that carry a caller's credential.
CLIENT_CREDENTIALS = frozenset({
    b"authorization", b"proxy-authorization", b"x-api-key", b"api-key", b"cookie",
})
# Words in a header name that say it carries a secret (x-goog-api-key, x-auth-token, ...).
_SECRET_WORDS = ("auth", "key", "token", "secret", "passw", "cookie", "credential", "session")
# Set by the relay itself, or hop-by-hop: a static value would break the exchange.
_RELAY_OWNED = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te",
    "trailer", "upgrade", "expect", "proxy-connection", "x-request-id", "accept-encoding",
})
IDENTITY = (b"Accept-Encoding", b"identity")
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VALUE = re.compile(r"^[^\x00-\x08\x0a-\x1f\x7f]*$")


def looks_like_credential(name: str) -> bool:
    low = name.lower()
    return low.encode() in CLIENT_CREDENTIALS or any(w in low for w in _SECRET_WORDS)


def check_static_headers(headers: dict[str, str], auth_header: str | None = None) -> None:
    """Raises ValueError naming the first header that cannot be a static upstream header."""
    for name, value in headers.items():
        if not _TOKEN.match(name):
            raise ValueError(f"{name!r} is not a header name")
        if not _VALUE.match(value) or value != value.strip(" \t"):
            raise ValueError(f"{name!r}: the value has control characters or edge spaces")
        low = name.lower()
        if low in _RELAY_OWNED:
            raise ValueError(f"{name!r} is set by the relay")
        if looks_like_credential(name) or (auth_header and low == auth_header.lower()):
            raise ValueError(
                f"{name!r} looks like a credential: secrets only through auth_header + "
                "auth_value_env (read from the environment), never in the file")


def fixed_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers an upstream adds to every request besides its key: identity coding, then
    its static ones (`headers.upstream_request_headers` puts the key last)."""
    return [IDENTITY] + [(k.encode(), v.encode()) for k, v in headers.items()]
