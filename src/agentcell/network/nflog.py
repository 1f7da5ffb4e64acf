"""Reading what the host firewall rejected: NFLOG over NETLINK_NETFILTER, stdlib sockets only.

A reader binds one NFLOG group (groups are exclusive: each host-firewall cell gets its own, see
:func:`open_group`) *before* the cell starts, so nothing is lost; the kernel queues messages on the
socket until they are read. Each logged packet becomes an event like the proxy's: time, destination
(address, protocol, port), uid where the packet had a socket, and the rule that would allow it.

Message layout (linux/netfilter/nfnetlink_log.h): nlmsghdr, nfgenmsg, then attributes; a packet
message carries NFULA_PAYLOAD (the IP packet from its header on), NFULA_UID, NFULA_PREFIX.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import time
from typing import Any

from ..netlink import set_rcvbuf

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET, NFULNL_MSG_CONFIG = 0, 1
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = 1, 2, 3, 4
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_PAYLOAD, NFULA_PREFIX, NFULA_UID = 9, 10, 11
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
GROUPS = range(0x4100, 0x4100 + 4096)  # one per host-firewall cell at a time

_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


def _config(sock: socket.socket, group: int, attrs: bytes, seq: int) -> None:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(group)) + attrs
    msg = _NLMSG.pack(_NLMSG.size + len(body), (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
                      NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body
    sock.send(msg)
    reply = sock.recv(65536)
    _len, kind, _flags, _seq, _pid = _NLMSG.unpack_from(reply)
    if kind == NLMSG_ERROR:
        err = -struct.unpack_from("=i", reply, _NLMSG.size)[0]
        if err:
            raise OSError(err, os.strerror(err))


class Reader:
    """An NFLOG group bound for one cell; :meth:`events` drains what arrived."""

    def __init__(self, sock: socket.socket, group: int) -> None:
        self.sock, self.group = sock, group

    def fileno(self) -> int:
        """Readable when a refused packet has been logged."""
        return self.sock.fileno()

    def events(self, limit: int = 4096) -> list[dict[str, Any]]:
        """The refused packets logged since the last call (at most ``limit`` reads: the caller's loop
        must come round, a flood cannot keep it here)."""
        out: list[dict[str, Any]] = []
        self.sock.setblocking(False)
        for _ in range(limit):
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # the kernel dropped some: say so rather than pretend
                    out.append({"ts": time.time(), "operation": "network", "source": "nftables",
                                "target": "?", "reason": "some rejected packets were not recorded (queue full)"})
                    continue
                return out
            out += list(_parse(data))
        return out

    def close(self) -> None:
        self.sock.close()


def open_group() -> Reader:
    """Bind the first free group in GROUPS (EBUSY: another cell's)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        set_rcvbuf(sock, 1 << 20)
        for seq, group in enumerate(GROUPS, 1):
            try:
                _config(sock, group, _attr(NFULA_CFG_CMD, struct.pack("=Bxxx", NFULNL_CFG_CMD_BIND)), seq)
            except OSError as e:
                if e.errno == errno.EBUSY:
                    continue
                raise
            # Each packet at once (the kernel batches 100, or a second, by default: the end of a run
            # would be lost), its first 128 bytes (headers enough for address and port).
            _config(sock, group, _attr(NFULA_CFG_MODE, struct.pack("!IBx", 128, NFULNL_COPY_PACKET))
                    + _attr(NFULA_CFG_QTHRESH, struct.pack("!I", 1)) + _attr(NFULA_CFG_TIMEOUT, struct.pack("!I", 1)),
                    seq)
            return Reader(sock, group)
        raise OSError(errno.EBUSY, "every NFLOG group agentcell uses is taken")
    except BaseException:
        sock.close()
        raise


def _parse(data: bytes) -> list[dict[str, Any]]:
    out = []
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            break
        if kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            attrs = _attrs(data[off + _NLMSG.size + _NFGEN.size: off + length])
            event = _packet_event(attrs)
            if event is not None:
                out.append(event)
        off += (length + 3) & ~3
    return out


def _attrs(buf: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(buf):
        length, kind = struct.unpack_from("=HH", buf, off)
        if length < 4:
            break
        out[kind & 0x7FFF] = buf[off + 4: off + length]
        off += (length + 3) & ~3
    return out


def _packet_event(attrs: dict[int, bytes]) -> dict[str, Any] | None:
    pkt = attrs.get(NFULA_PAYLOAD, b"")
    if not pkt:
        return None
    version = pkt[0] >> 4
    dst: ipaddress.IPv4Address | ipaddress.IPv6Address
    if version == 4 and len(pkt) >= 20:
        proto, dst = pkt[9], ipaddress.IPv4Address(pkt[16:20])
        l4 = pkt[(pkt[0] & 0xF) * 4:]
    elif version == 6 and len(pkt) >= 40:
        proto, dst = pkt[6], ipaddress.IPv6Address(pkt[24:40])
        l4 = pkt[40:]
    else:
        return None
    names = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmpv6"}
    name = names.get(proto, str(proto))
    port = struct.unpack_from("!H", l4, 2)[0] if proto in (6, 17) and len(l4) >= 4 else None
    sport = struct.unpack_from("!H", l4, 0)[0] if proto in (6, 17) and len(l4) >= 4 else None
    where = f"[{dst}]" if version == 6 else str(dst)
    target = f"{where}:{port}" if port is not None else where
    uid = struct.unpack("!I", attrs[NFULA_UID])[0] if len(attrs.get(NFULA_UID, b"")) == 4 else None
    allow = f"{'' if name == 'tcp' else name + ':'}{where}:{port}" if port is not None else None
    return {"ts": time.time(), "operation": "network", "source": "nftables", "target": target, "protocol": name,
            "uid": uid, "sport": sport, "prefix": attrs.get(NFULA_PREFIX, b"").rstrip(b"\0").decode(errors="replace"),
            "reason": f"not allowed by the host firewall: add --allow-egress {allow} to allow it" if allow else
            f"not allowed by the host firewall ({name})"}
