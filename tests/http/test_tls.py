"""Unit tests for relay/http/tls.py: the client context and the words for a TLS failure."""

from __future__ import annotations

import ssl

import pytest

from relay.http.tls import client_context, describe
from tests.support.need import need_extra


def test_context_verifies_by_default():
    ctx = client_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2


def test_context_without_verification_only_when_asked():
    ctx = client_context(verify=False)
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


def test_ca_file_replaces_the_system_store(tmp_path):
    trustme = need_extra("test", "trustme")
    ca = trustme.CA()
    pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    ctx = client_context(ca_file=str(pem))
    assert len(ctx.get_ca_certs()) == 1
    with pytest.raises(FileNotFoundError):
        client_context(ca_file=str(tmp_path / "missing.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        client_context(ca_file=str(bad))


def _verify_error(message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(
        1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: {message} (_ssl.c:1006)"
    )
    exc.verify_message = message
    exc.verify_code = 20
    return exc


@pytest.mark.parametrize(
    "exc,words",
    [
        (
            _verify_error("unable to get local issuer certificate"),
            "certificate verify failed: unable to get local issuer certificate",
        ),
        (
            _verify_error("Hostname mismatch, certificate is not valid for 'wrong.example'."),
            "certificate verify failed: hostname mismatch, certificate is not valid for "
            "'wrong.example'",
        ),
        (
            _verify_error("certificate has expired"),
            "certificate verify failed: certificate has expired",
        ),
        (
            ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
            "wrong version number",
        ),
        (
            ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:2406)"),
            "EOF occurred in violation of protocol",
        ),
    ],
)
def test_describe(exc, words):
    assert describe(exc) == words
