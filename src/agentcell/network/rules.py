"""Egress rules: which destinations the proxy may connect a cell to. Pure: no I/O, no sockets.

A rule is a domain pattern with an optional port: ``example.com`` (that name), ``*.example.com`` (any
name below it, not the name itself), ``*`` (every name: an allow-all that still refuses private
addresses); ``:443``, ``:*`` (any port). Without a port a rule covers 80 and 443 (HTTP and HTTPS).
Deny rules win over allow rules. IP addresses and networks are never matched by a domain rule: an
IP literal destination, and a name that resolves into a non-public range (loopback, private,
link-local — the cloud metadata address 169.254.169.254 among them —, carrier NAT, benchmark,
documentation, multicast, unspecified), is refused unless an ``--allow-range CIDR`` covers it.

Rules travel in the cell's spec as text (``allow:PATTERN``, ``deny:PATTERN``, ``range:CIDR``,
``resolver:ADDR[:PORT]``), so a spec stays a flat, serialisable value.
"""
from __future__ import annotations

import ipaddress

from ..errors import PolicyError

DEFAULT_PORTS = (80, 443)
ANY_PORT = -1
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Pattern:
    """One domain rule: ``host`` (lower case, no trailing dot), ``wildcard`` for ``*.host``, ``ports``."""

    __slots__ = ("text", "host", "wildcard", "ports")

    def __init__(self, text: str, host: str, wildcard: bool, ports: tuple[int, ...]) -> None:
        self.text, self.host, self.wildcard, self.ports = text, host, wildcard, ports

    def matches(self, host: str, port: int) -> bool:
        if self.ports != (ANY_PORT,) and port not in self.ports:
            return False
        if self.host == "*":
            return True
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


def normalise_host(host: str) -> str:
    return host.strip().rstrip(".").lower()


_LABEL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def host_name_fault(host: str) -> str:
    """Empty if ``host`` is a destination a client may name: an IP address (an IPv6 one in brackets or
    not), or a DNS host name (ASCII letters, digits, '-' and '_' in labels of 1 to 63 characters, neither
    starting nor ending with '-', at most 253 characters, one final dot allowed); else what is wrong with
    it. Nothing else reaches a resolver or the allow-list: a NUL, a space or a control character in a
    name is a different name to each of them. No IPv6 zone (``fe80::1%eth0``): it names an interface of
    the host."""
    if "%" in host:
        return "not a host name (an IPv6 zone names an interface of the host)"
    if _is_ip(host.removeprefix("[").removesuffix("]")):
        return ""
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253:
        return "not a host name (empty, or longer than 253 characters)"
    for label in name.split("."):
        if not 0 < len(label) <= 63:
            return "not a host name (an empty label, or one longer than 63 characters)"
        if not set(label) <= _LABEL:
            return "not a host name (a character other than a letter, a digit, '-' or '_')"
        if label[0] == "-" or label[-1] == "-":
            return "not a host name (a label starts or ends with '-')"
    return ""


def parse_pattern(text: str, field: str = "--allow-domain") -> Pattern:
    """``PATTERN[:PORT]``; a clear one-line error for anything else."""
    raw = text.strip()
    host, sep, port_text = raw.rpartition(":") if ":" in raw else (raw, "", "")
    if not sep:
        host = raw
    host = normalise_host(host)
    if sep:
        if port_text == "*":
            ports: tuple[int, ...] = (ANY_PORT,)
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            ports = (int(port_text),)
        else:
            raise PolicyError(field, f"'{text}': the port must be a number 1-65535 or *", "e.g. example.com:8443")
    else:
        ports = DEFAULT_PORTS
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if name != "*":
        labels = name.split(".")
        if not name or any(not label or not set(label) <= _LABEL_CHARS for label in labels) or _is_ip(name):
            raise PolicyError(field, f"'{text}' is not a domain pattern",
                              "use a name like example.com or *.example.com (addresses: --allow-range CIDR)")
    return Pattern(text, name, wildcard, ports)


def parse_range(text: str, field: str = "--allow-range") -> Network:
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise PolicyError(field, f"'{text}' is not an address or network", "e.g. 10.1.2.0/24 or fd00::/8") from None


def parse_resolver(text: str, field: str = "--resolver") -> tuple[str, int]:
    raw = text.strip()
    if raw.startswith("["):  # [v6]:port
        addr, _, rest = raw[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif raw.count(":") == 1:
        addr, port = raw.split(":")
    else:
        addr, port = raw, "53"
    if not _is_ip(addr) or not port.isdigit() or not 0 < int(port) < 65536:
        raise PolicyError(field, f"'{text}' is not ADDR[:PORT]", "e.g. 192.0.2.53 or [2001:db8::53]:5353")
    return addr, int(port)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"),)
NOT_PUBLIC_V6 = (ipaddress.IPv6Network("fec0::/10"), ipaddress.IPv6Network("64:ff9b:1::/48"),
                 ipaddress.IPv6Network("::ffff:0:0:0/96"))


def _embedded_v4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: ::ffff:a.b.c.d, ::a.b.c.d, 64:ff9b::a.b.c.d."""
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    packed = addr.packed
    if packed[:12] == bytes(12) and packed[12:] not in (bytes(4), b"\0\0\0\1"):  # not :: or ::1
        return ipaddress.IPv4Address(packed[12:])
    if any(addr in net for net in NAT64):
        return ipaddress.IPv4Address(packed[12:])
    return None


class Policy:
    """The compiled rules of one cell."""

    def __init__(self, allow: list[Pattern], deny: list[Pattern], ranges: list[Network],
                 resolver: tuple[str, int] | None) -> None:
        self.allow, self.deny, self.ranges, self.resolver = allow, deny, ranges, resolver

    @classmethod
    def from_rules(cls, rules: tuple[str, ...] | list[str]) -> Policy:
        allow, deny, ranges, resolver = [], [], [], None
        for rule in rules:
            kind, _, value = rule.partition(":")
            if kind == "allow":
                allow.append(parse_pattern(value))
            elif kind == "deny":
                deny.append(parse_pattern(value, "--deny-domain"))
            elif kind == "range":
                ranges.append(parse_range(value))
            elif kind == "resolver":
                resolver = parse_resolver(value)
            else:
                raise PolicyError("egress", f"unknown rule '{rule}'", "allow:, deny:, range: or resolver:")
        return cls(allow, deny, ranges, resolver)

    def name_verdict(self, host: str, port: int) -> tuple[bool, str]:
        """(allowed, why) for a destination named by the client, before any resolution."""
        host = normalise_host(host)
        if _is_ip(host.strip("[]")):
            addr = ipaddress.ip_address(host.strip("[]"))
            if self.range_allows(addr):
                return True, f"address {addr} in --allow-range"
            return False, f"an address, not a name: add --allow-range {addr} to allow it"
        for p in self.deny:
            if p.matches(host, port):
                return False, f"denied by --deny-domain {p.text}"
        for p in self.allow:
            if p.matches(host, port):
                return True, f"allowed by --allow-domain {p.text}"
        return False, f"not on the allow-list: add --allow-domain {host}" + (
            "" if port in DEFAULT_PORTS else f":{port}") + " to allow it"

    def range_allows(self, addr: Address) -> bool:
        return any(addr in net for net in self.ranges)

    def address_verdict(self, addr: Address) -> tuple[bool, str]:
        """(allowed, why) for an address a name resolved to: public, or in an --allow-range. An IPv6
        address that carries an IPv4 one (mapped, compatible, NAT64) is judged by that one too. The
        host's loopback never: the proxy runs in the host's network, so an --allow-range that covers
        127.0.0.0/8 would open the host's own services (the cell has a loopback of its own)."""
        inner = _embedded_v4(addr) if isinstance(addr, ipaddress.IPv6Address) else addr
        if addr.is_loopback or (inner is not None and inner.is_loopback):
            return False, f"{addr} is the host's loopback: a cell reaches its own, never the host's"
        if self.range_allows(addr):
            return True, ""
        bad = f"resolves to {addr}, which is not a public address (add --allow-range {addr} to allow it)"
        if isinstance(addr, ipaddress.IPv6Address):
            inner = _embedded_v4(addr)
            if inner is not None:
                ok, _why = self.address_verdict(inner)
                return (True, "") if ok else (False, bad)
            if any(addr in net for net in NOT_PUBLIC_V6):
                return False, bad
        if not addr.is_global or addr.is_multicast:
            return False, bad
        return True, ""


def compile_rules(allow: list[str], deny: list[str], ranges: list[str], resolver: str | None) -> tuple[str, ...]:
    """The rules as the spec carries them, each checked now (bad input: one line naming the field)."""
    text = ([f"allow:{p}" for p in allow] + [f"deny:{p}" for p in deny] + [f"range:{r}" for r in ranges]
            + ([f"resolver:{resolver}"] if resolver else []))
    Policy.from_rules(text)
    return tuple(text)
