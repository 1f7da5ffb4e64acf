"""The session CA: what a TLS client in the cell will accept from the proxy, checked by OpenSSL itself
(Python's ssl) over loopback."""
from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentcell.network.tlsca import SessionCA


def handshake(tmp_path: Path, ca: SessionCA, chain: bytes, key: bytes, name: str) -> str:
    """Serve ``chain`` on loopback; connect trusting only ``ca``, asking for ``name``: "" or the error."""
    (tmp_path / "chain.pem").write_bytes(chain)
    (tmp_path / "key.pem").write_bytes(key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "chain.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cadata=ca.pem.decode())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as s:
                    s.recv(1)
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port)) as raw, \
                    client.wrap_socket(raw, server_hostname=name) as s:
                s.sendall(b"x")
            return ""
        except ssl.SSLError as e:
            return str(e)
        finally:
            t.join(5)


def test_a_leaf_for_a_bound_host_is_trusted_in_the_cell(tmp_path: Path) -> None:
    ca = SessionCA("s1", ("api.example.test", "127.0.0.1"))
    assert handshake(tmp_path, ca, *ca.leaf("API.example.test."), "api.example.test") == ""
    assert handshake(tmp_path, ca, *ca.leaf("127.0.0.1"), "127.0.0.1") == ""
    # the right certificate, the wrong name asked for
    assert "mismatch" in handshake(tmp_path, ca, *ca.leaf("api.example.test"), "other.example.test")


def test_the_ca_cannot_vouch_for_any_other_host_even_with_its_own_key(tmp_path: Path) -> None:
    ca = SessionCA("s1", ("api.example.test",))
    with pytest.raises(ValueError, match="not one of this session's bound hosts"):
        ca.leaf("github.example.test")
    # A leaf for another name signed with the CA's key (as a stolen key would make): its name constraints
    # refuse it (a bound host's subdomains they cannot: a DNS subtree is a name and all below it).
    for name in ("github.example.test", "example.test", "xapi.example.test", "127.0.0.1"):
        key = ec.generate_private_key(ec.SECP256R1())
        forged = (x509.CertificateBuilder()
                  .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                  .issuer_name(ca.cert.subject).public_key(key.public_key())
                  .serial_number(x509.random_serial_number())
                  .not_valid_before(ca.not_before).not_valid_after(ca.not_after)
                  .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))
                                                              if name[0].isdigit() else x509.DNSName(name)]),
                                 critical=False)
                  .sign(ca._key, hashes.SHA256()))
        pem = forged.public_bytes(serialization.Encoding.PEM) + ca.pem
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        assert "verify failed" in handshake(tmp_path, ca, pem, key_pem, name), name


def test_the_ca_is_a_constrained_short_lived_ca_and_never_shows_its_key() -> None:
    ca = SessionCA("s1", ("api.example.test",))
    basic = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    constraints = ca.cert.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    assert constraints.value.permitted_subtrees == [x509.DNSName("api.example.test")]
    assert ca.not_after - ca.not_before <= datetime.timedelta(days=1, minutes=5)
    assert "PRIVATE" not in repr(ca) and "key" not in repr(ca).lower()
    with pytest.raises(ValueError, match="at least one host"):
        SessionCA("s1", ())
