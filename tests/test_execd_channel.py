"""The supervisor's end of a live cell's exec-server channel (:class:`agentcell.cell.execd.Channel`) over a
real socket pair whose other end stands for an exec server that does not read (a command stopped it):
nothing blocks, what waits is bounded and goes in order once read, and no fd of ours is left behind."""
from __future__ import annotations

import _socket
import errno
import os
import select
import signal
from collections.abc import Iterator

import pytest

from agentcell.cell import execd


@pytest.fixture(autouse=True)
def never_hangs() -> Iterator[None]:
    """A send that blocks (the bug these tests are about) fails the test instead of hanging the run."""
    def late(_sig: int, _frame: object) -> None:
        raise TimeoutError("a channel operation blocked")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fds(pipe: int) -> int:
    """Our fds open on ``pipe``'s pipe (the ends, and any copy of them): counted by the pipe, not all of the
    process's fds, which other tests' threads in this process may open and close meanwhile."""
    ino = os.fstat(pipe).st_ino
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:  # (the listing's own fd, closed by now)
            continue
        n += st.st_ino == ino and st.st_dev == os.fstat(pipe).st_dev
    return n


class Server:
    """The exec server's end, reading requests as :func:`agentcell.cell.execd.serve` does."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock, self.buf, self.fds = sock, b"", []  # type: list[int]

    def take(self) -> list[tuple[dict[str, object], list[int]]]:
        """The requests complete so far, after one read (waits for it up to 10 s)."""
        import marshal

        select.select([self.sock], [], [], 10)
        chunk, anc, _f, _a = self.sock.recvmsg(1 << 20, _socket.CMSG_SPACE(execd.MAX_FDS * 4), _socket.MSG_DONTWAIT)
        assert chunk, "the channel closed"
        self.buf += chunk
        self.fds += execd.unpack_fds(anc)
        out = []
        while len(self.buf) >= execd._REQUEST.size:
            length, n = execd._REQUEST.unpack_from(self.buf)
            if len(self.buf) < execd._REQUEST.size + length:
                break
            out.append((marshal.loads(self.buf[execd._REQUEST.size:execd._REQUEST.size + length]), self.fds[:n]))
            self.buf, self.fds = self.buf[execd._REQUEST.size + length:], self.fds[n:]
        return out


def test_a_server_that_does_not_read_never_blocks_its_supervisor_and_gets_it_all_in_order() -> None:
    ours, server = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    channel = execd.Channel(ours)
    r, w = os.pipe()
    try:
        sent = 0
        for rid in range(1, 40):  # ~6 MB: far more than the socket holds (every send returns at once)
            channel.exec(rid, ["true"], {b"BIG": b"x" * 150_000}, "/", {0: r, 1: w, 2: w})
            channel.signal(rid, 15)
            sent = rid
        assert channel.pending
        got: list[tuple[dict[str, object], list[int]]] = []
        reader = Server(server)
        while len(got) < 2 * sent:  # the server reads; what waited goes as it does
            channel.flush()
            got += reader.take()
        assert [(m["op"], m["id"]) for m, _ in got] == [(op, rid) for rid in range(1, sent + 1)
                                                         for op in ("exec", "signal")]
        for m, fds in got:  # each exec came with its three fds (copies of the pipe's ends), a signal with none
            assert len(fds) == (3 if m["op"] == "exec" else 0)
            assert all(os.fstat(fd).st_ino == os.fstat(r).st_ino for fd in fds)
            for fd in fds:
                os.close(fd)
        assert not channel.pending
        assert _fds(r) == 2  # (the pipe's two ends): no copy of ours is left
    finally:
        channel.close()
        server.close()
        os.close(r)
        os.close(w)


def test_what_waits_for_a_server_that_does_not_read_is_bounded_and_its_fds_go_with_it() -> None:
    ours, server = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    channel = execd.Channel(ours)
    r, w = os.pipe()
    keep = os.dup(r)  # (to count the pipe's fds by once the ends are closed)
    try:
        with pytest.raises(OSError) as refused:
            for rid in range(1, 10_000):
                channel.exec(rid, ["true"], {}, "/", {0: r, 1: w, 2: w})
        assert refused.value.errno == errno.ENOBUFS
        assert 3 + 3 <= _fds(r) <= 3 + 3 * execd.MAX_HELD  # (the pipe's ends, ours, and the copies held: bounded)
        waiting = len(channel._out)
        channel.signal(1, 9)  # a kill still waits its turn: never lost to the bound
        assert len(channel._out) == waiting + 1 and channel._out[-1][1] == []
    finally:
        channel.close()
        server.close()
        os.close(r)
        os.close(w)
    try:
        assert _fds(keep) == 1  # closed: every copy that waited went with it
    finally:
        os.close(keep)
