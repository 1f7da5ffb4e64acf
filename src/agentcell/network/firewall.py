"""``--net host-firewall``: no network namespace; an nftables table on the host keyed on the agent's uid.

For account identities only (a rootless cell has no uid of its own to key on). While the cell runs,
a table ``inet agentcell_<cell>`` holds one output chain: packets of any other uid pass untouched;
the agent's go out only to what ``--allow-egress`` names (and to ``lo`` with ``--allow-loopback``);
everything else it sends, IPv4 and IPv6, TCP, UDP or other, is logged to an NFLOG group of the
cell's own (:mod:`.nflog` reads it: the run's ``egress_blocked``, and the escape monitor) and
rejected (a reset or an ICMP error: a dropped SYN would make connect() hang). A reject in our table
is final whatever other tables accept.

The table is recorded in ``/run/agentcell/nft/<table>`` (with the supervisor's pid) *before* it is
made and removed after the cell; :func:`sweep` removes the tables of supervisors that died.
"""
from __future__ import annotations

import ipaddress
import os
import subprocess

from .. import hostfs
from ..errors import LaunchError, PolicyError

RECORDS = f"{hostfs.RUN}/nft"
PRESETS = {"seed": ("tcp:*:443",)}  # the seed's "egress: allow 443 only; deny all else"


class EgressRule:
    __slots__ = ("proto", "net", "port")

    def __init__(self, proto: str, net: ipaddress.IPv4Network | ipaddress.IPv6Network | None, port: int | None):
        self.proto, self.net, self.port = proto, net, port

    def nft(self) -> str:
        parts = []
        if self.net is not None:
            parts.append(f"{'ip' if self.net.version == 4 else 'ip6'} daddr {self.net}")
        if self.port is not None:
            parts.append(f"{self.proto} dport {self.port}")
        else:
            parts.append(f"meta l4proto {self.proto}")
        return " ".join(parts) + " accept"


def parse_egress(text: str, field: str = "--allow-egress") -> list[EgressRule]:
    """``[tcp:|udp:]ADDR|CIDR|*:PORT|*`` (tcp unless said), or a preset name (``seed``)."""
    raw = text.strip()
    if raw in PRESETS:
        return [r for t in PRESETS[raw] for r in parse_egress(t, field)]
    proto = "tcp"
    for p in ("tcp:", "udp:"):
        if raw.startswith(p):
            proto, raw = p[:-1], raw[len(p):]
    where, sep, port_text = raw.rpartition(":")
    if not sep or not where:
        raise PolicyError(field, f"'{text}' is not [tcp:|udp:]ADDRESS:PORT", "e.g. *:443, 10.1.0.0/16:5432, udp:*:53")
    if where.startswith("[") and where.endswith("]"):
        where = where[1:-1]
    try:
        net = None if where == "*" else ipaddress.ip_network(where, strict=False)
    except ValueError:
        raise PolicyError(field, f"'{where}' is not an address, network or *",
                          "name addresses (the firewall sees no names; --net proxy allows domains)") from None
    if port_text == "*":
        port = None
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise PolicyError(field, f"'{text}': the port must be 1-65535 or *", "e.g. *:443")
    return [EgressRule(proto, net, port)]


def table_name(cell_id: str) -> str:
    return "agentcell_" + "".join(c for c in cell_id.removeprefix("agentcell-") if c.isalnum())[:24]


# Never reached through a "*" rule, only by naming the address or network: the host itself,
# private and link-local networks (the cloud metadata address among them), carrier NAT.
# Multicast and broadcast too (they reach the local network whatever the address rules say), and the
# IPv6 forms that carry an IPv4 address (NAT64, 6to4, compatible) or are site-local.
NOT_BY_WILDCARD = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                   "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "::/96", "::ffff:0:0/96", "64:ff9b::/96",
                   "64:ff9b:1::/48", "2002::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8")


def ruleset(table: str, uid: int, rules: list[EgressRule], allow_loopback: bool, log_group: int) -> str:
    """Only packets of the agent's sockets enter the ``agent`` chain (a positive match: the reset a
    reject sends back has no socket, and must not be rejected in turn). In order: lo and the host's
    own addresses (only with --allow-loopback), rules that name addresses, then the non-public
    ranges are refused, then the ``*`` rules, then the refusal of everything else."""
    lines = [f"table inet {table} {{", "  chain deny {", f'    log group {log_group} prefix "{table} "',
             "    meta l4proto tcp reject with tcp reset", "    reject with icmpx type admin-prohibited", "  }",
             "  chain agent {"]
    if allow_loopback:
        lines += ['    oifname "lo" accept', "    fib daddr type local accept"]
    else:
        lines += ['    oifname "lo" goto deny', "    fib daddr type local goto deny"]
    lines.append("    fib daddr type { broadcast, multicast, anycast } goto deny")
    lines += [f"    {r.nft()}" for r in rules if r.net is not None]
    v4 = ", ".join(n for n in NOT_BY_WILDCARD if ":" not in n)
    v6 = ", ".join(n for n in NOT_BY_WILDCARD if ":" in n)
    lines += [f"    ip daddr {{ {v4} }} goto deny", f"    ip6 daddr {{ {v6} }} goto deny"]
    lines += [f"    {r.nft()}" for r in rules if r.net is None]
    lines += ["    goto deny", "  }", "  chain out {", "    type filter hook output priority filter; policy accept;",
              f"    meta skuid {uid} jump agent", "  }", "}"]
    return "\n".join(lines) + "\n"


def _nft(script: str) -> None:
    try:
        p = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
    except FileNotFoundError:
        raise LaunchError("firewall", "nft is not installed", "apt-get install nftables") from None
    if p.returncode != 0:
        raise LaunchError("firewall", f"nft refused the rules: {p.stderr.strip().splitlines()[-1:]}")


class HostFirewall:
    """The table of one cell: made by :meth:`create`, gone after :meth:`remove`."""

    def __init__(self, table: str, record: str) -> None:
        self.table, self.record = table, record

    @classmethod
    def create(cls, cell_id: str, uid: int, rules: list[EgressRule], allow_loopback: bool,
               log_group: int) -> HostFirewall:
        if os.geteuid() != 0:
            raise LaunchError("firewall", "host-firewall rules need root", "run through sudo with --as")
        sweep()
        table = table_name(cell_id)
        hostfs.run_dir("nft")
        record = os.path.join(RECORDS, table)
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())  # recorded before it exists: always found again
        finally:
            os.close(fd)
        fw = cls(table, record)
        try:
            _nft(ruleset(table, uid, rules, allow_loopback, log_group))
        except BaseException:
            fw.remove()
            raise
        return fw

    def remove(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        try:
            os.unlink(self.record)
        except FileNotFoundError:
            pass


    def adopt(self) -> None:
        """This process owns the table from now on (its maker handed it over): the record says so, so
        that the maker's end does not get it swept while we still need it."""
        fd = os.open(self.record, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)


def exists(table: str) -> bool:
    return subprocess.run(["nft", "list", "table", "inet", table], capture_output=True).returncode == 0


def sweep() -> list[str]:
    """Remove tables whose supervisor is gone (killed before it could); the tables removed."""
    removed: list[str] = []
    try:
        names = os.listdir(RECORDS)
    except OSError:
        return removed
    for name in names:
        record = os.path.join(RECORDS, name)
        try:
            with open(record) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        alive = False
        if pid > 0:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive = b"agentcell" in f.read()
            except OSError:
                alive = False
        if not alive and name.startswith("agentcell_"):
            HostFirewall(name, record).remove()
            removed.append(name)
    return removed
