"""A session's own certificate authority, for the proxy to stand in for the hosts a secret is bound to.

The cell trusts this CA (its certificate goes into the cell's trust bundle); the proxy terminates TLS
for a bound host with a leaf certificate the CA signed, so it can put the real credential where the
cell sent a placeholder. What keeps this from being a general man-in-the-middle key:

* **Name constraints.** The CA is valid only for the bound hosts (RFC 5280 name constraints, marked
  critical: a verifier that does not understand them must refuse the chain). Even a leaked CA key
  could not vouch for any other name to the cell, but for the bound hosts' own subdomains (a DNS
  subtree is the name and every name below it: X.509 has no "this name only"). OpenSSL (curl, git,
  Python, Node), Go and rustls enforce them.
* **The key never leaves the supervisor.** Every leaf is made up front, for the bound hosts only, when
  the session starts; the proxy (another process, running as ``nobody``) gets the leaves' keys, never
  the CA's. The CA's key is not written anywhere.
* **Short-lived.** A day at most (a session's life), P-256 keys, made fresh per session.

Upstream, the proxy verifies the real host against the host's own trust store: this CA is never
trusted outside the cell.
"""
from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = datetime.timedelta(days=1)
SKEW = datetime.timedelta(minutes=5)  # a clock a little behind still accepts it


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host.lower().rstrip("."))


def _subtree(host: str) -> x509.GeneralName:
    """The name constraint for one host: that name (and, X.509 being what it is, its subdomains), an
    address as a /32 or /128."""
    try:
        ip = ipaddress.ip_address(host)
        return x509.IPAddress(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}"))
    except ValueError:
        return x509.DNSName(host.lower().rstrip("."))


class SessionCA:
    """A CA for ``hosts`` alone; :meth:`leaf` for each of them, :attr:`pem` for the cell's trust."""

    def __init__(self, session: str, hosts: tuple[str, ...]) -> None:
        if not hosts:
            raise ValueError("a session CA needs at least one host to stand in for")
        self.hosts = tuple(dict.fromkeys(h.lower().rstrip(".") for h in hosts))
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.not_before, self.not_after = now - SKEW, now + VALID
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentcell"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"agentcell session {session}"[:64])])
        self._name = name
        ips = [h for h in self.hosts if isinstance(_subtree(h), x509.IPAddress)]
        permitted = [_subtree(h) for h in self.hosts]
        excluded: list[x509.GeneralName] | None = None
        if not ips:  # no address at all: say so (a constraint naming no IP would leave every IP open)
            excluded = [x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")), x509.IPAddress(ipaddress.ip_network("::/0"))]
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before).not_valid_after(self.not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=excluded),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def leaf(self, host: str) -> tuple[bytes, bytes]:
        """(certificate chain, private key), PEM, for one of the CA's hosts."""
        host = host.lower().rstrip(".")
        if host not in self.hosts:
            raise ValueError(f"{host} is not one of this session's bound hosts")
        key = ec.generate_private_key(ec.SECP256R1())
        san = _general_name(host)
        # An address gets no common name: OpenSSL checks a common name that looks like a host name
        # against the DNS constraints (and "127.0.0.1" looks like one); the subject is then empty and
        # the alternative name critical, as RFC 5280 asks.
        ip = isinstance(san, x509.IPAddress)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([] if ip else [x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before).not_valid_after(self.not_after)
            .add_extension(x509.SubjectAlternativeName([san]), critical=ip)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.pem
        return chain, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())

    def __repr__(self) -> str:  # (never the key)
        return f"SessionCA(hosts={self.hosts!r}, until={self.not_after.isoformat()})"


def read_bundle(path: str, field: str) -> str:
    """``--upstream-ca``: a PEM file of CA certificates (a regular file, not through a link), as text."""
    from ..errors import AgentcellError
    from ..hostfs import read_regular

    fix = "give a PEM file of CA certificates"
    try:
        pem = read_regular(path, field, fix, limit=4 << 20).decode("ascii")
    except UnicodeDecodeError:
        raise AgentcellError(field, f"{path} is not PEM text", fix) from None
    if "-----BEGIN CERTIFICATE-----" not in pem:
        raise AgentcellError(field, f"{path} holds no PEM certificate", fix)
    return pem


SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's, what the host trusts
# Where each runtime in the cell looks for the CAs it trusts: the bundle (the host's CAs and the
# session's), or for Node, which adds to its own, the session's CA alone.
BUNDLE_KNOBS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT",
                "AWS_CA_BUNDLE", "DENO_CERT")
CA_KNOBS = ("NODE_EXTRA_CA_CERTS",)


class CellTrust:
    """The session CA's certificate, and a bundle of it with the host's CAs, in a directory the cell
    gets read-only (``/run/agentcell/trust/CELL``, a user's ``<state dir>/trust/CELL``: the host's side
    stays the supervisor's; the cell sees the path it is bound at); :meth:`env` points every runtime's
    knob at them. Public certificates only.

    ``upstream``: the CAs given with ``--upstream-ca`` (a TLS-inspecting gateway's, which signs every
    host the cell reaches through it, not only those the proxy terminates) are trusted in the cell too,
    in both files: the user named them as the ones the way out is signed by."""

    def __init__(self, cell_id: str, ca: SessionCA, upstream: str | None = None) -> None:
        from .. import hostfs

        if not cell_id or "/" in cell_id or cell_id.startswith("."):
            raise ValueError(f"a cell id names a directory: {cell_id!r}")
        # root's in /run/agentcell; a user's (a rootless session's) in their own state, as its seed is
        top = hostfs.run_dir("trust") if os.geteuid() == 0 else \
            hostfs.private_dir(os.path.join(hostfs.private_dir(hostfs.state_dir()), "trust"))
        self.dir = os.path.join(top, cell_id)
        os.mkdir(self.dir, 0o755)
        try:
            self.ca = os.path.join(self.dir, "agentcell-session-ca.pem")
            self.bundle = os.path.join(self.dir, "ca-bundle.pem")
            try:
                with open(SYSTEM_BUNDLE, "rb") as f:
                    system = f.read()
            except OSError:
                system = b""
            extra = upstream.encode("ascii").rstrip(b"\n") + b"\n" if upstream else b""
            for path, data in ((self.ca, extra + ca.pem), (self.bundle, system.rstrip(b"\n") + b"\n" + extra + ca.pem)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644),
                          "wb") as f:
                    f.write(data)
        except BaseException:
            self.remove()
            raise

    def env(self) -> tuple[tuple[str, str], ...]:
        return (*((k, self.bundle) for k in BUNDLE_KNOBS), *((k, self.ca) for k in CA_KNOBS))

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
