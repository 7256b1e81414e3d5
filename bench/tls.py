"""Certificates for the TLS scenario: a private CA and a leaf for the simulator, made with
trustme (a test/bench dependency) in the run's temp dir. The relay trusts the CA through
`ca_file`, nginx through `proxy_ssl_trusted_certificate`; both verify the peer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NAME = "localhost"  # the name nginx checks (its check does not look at IP SANs)


@dataclass
class Pki:
    ca: Path  # the CA certificate (PEM) both proxies trust
    cert: Path  # the simulator's certificate chain (PEM)
    key: Path  # its private key (PEM)


def make(tmp: Path) -> Pki:
    import trustme

    tmp.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert(NAME, "127.0.0.1")
    pki = Pki(tmp / "ca.pem", tmp / "sim-cert.pem", tmp / "sim-key.pem")
    ca.cert_pem.write_to_path(str(pki.ca))
    with open(pki.cert, "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    leaf.private_key_pem.write_to_path(str(pki.key))
    return pki
