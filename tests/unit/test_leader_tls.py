"""Which forwarded control RPCs may go in plaintext (server.tenancy.tls.is_loopback, leader_credentials)."""

from __future__ import annotations

import pytest

from server.settings import Settings
from server.tenancy.tls import TLSConfigError, is_loopback, leader_credentials


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:8001", True), ("127.5.0.9:1", True), ("localhost:8001", True), ("[::1]:8001", True), ("::1", True),
        ("192.0.2.2:8001", False), ("10.0.0.1:8001", False), ("[fd00::2]:8001", False), ("control-0.control:8001", False),
        ("localhost.example.com:8001", False),
    ],
)  # fmt: skip
def test_only_loopback_addresses_of_this_host_count_as_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_no_tls_without_a_server_certificate_and_a_missing_ca_is_named(tmp_path):
    assert leader_credentials(Settings()) is None
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(TLSConfigError, match="nope.crt"):
        leader_credentials(Settings(tls_cert=cert, tls_key=key, tls_client_ca=tmp_path / "nope.crt"))
