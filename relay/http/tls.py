"""TLS towards `https://` upstreams: the client context, and a TLS failure in plain words.

Verification is on by default, against the system's trust store, with the hostname checked
(and sent as SNI) from the upstream URL's host. `ca_file` (PEM) replaces the system store
with a private CA. `verify = false` turns both checks off: only as an explicit choice, which
the relay logs at start (`upstream_tls_unverified`).

Only HTTP/1.1 is offered in ALPN: the relay speaks nothing else upstream.
"""

from __future__ import annotations

import re
import ssl

# What starts an ssl error's message (`[SSL: WRONG_VERSION_NUMBER] `) and what ends it
# (` (_ssl.c:1000)`).
_PREFIX = re.compile(r"^\[[A-Z0-9_]+: [A-Z0-9_]+\] ")
_SUFFIX = re.compile(r" \(_ssl\.c:\d+\)$")


def client_context(verify: bool = True, ca_file: str | None = None) -> ssl.SSLContext:
    """A context for connections to one upstream. Raises OSError / ssl.SSLError for an
    unreadable or invalid `ca_file` (the caller names the key)."""
    # The default context requires a certificate (CERT_REQUIRED) and checks the hostname.
    if verify:
        ctx = ssl.create_default_context(cafile=ca_file)
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def describe(exc: BaseException) -> str:
    """What went wrong in a TLS handshake, in the words an operator can act on, e.g.
    `certificate verify failed: unable to get local issuer certificate`."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or "unknown reason"
        if why.lower().startswith("hostname mismatch"):
            why = "hostname mismatch" + why[len("hostname mismatch") :]
        return f"certificate verify failed: {why.rstrip('.')}"
    text = str(exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], str) else exc)
    text = _SUFFIX.sub("", _PREFIX.sub("", text.strip()))
    return text or type(exc).__name__
