"""A live cell's host in two processes: the cell and its monitor in one, the clients' commands in the other.

The monitor is a thread of the process that holds the cell (:class:`agentcell.supervise.Supervised`). When
the clients' requests were served in that process too, every command's start and end woke both threads at
once, and each waited for the other's GIL: the monitor's reading of the command's fork, exec and exit
delayed the exit's relay to its client by about as much as the relay itself took. So the cell host
(:mod:`.server`) forks, before the cell exists (it is single-threaded then), a **relay**: the process that
serves the clients (their connections, the named cell's listener, the exec server's channel, timeouts and
signals), while the **keeper**, the original process, makes the cell, runs its monitor, proxy and table,
reaps it and takes it down. They speak over a SOCK_SEQPACKET socketpair (:mod:`.wire`)::

  keeper -> {"event": "opened", "cell_id", "pid1", "env": {b"K": b"V"}, "cwd": DIR} + fd [the exec server's channel]
          | {"event": "error", "field", "message", "code"}       (the cell did not start; nothing runs)
  keeper -> {"event": "escape" | "note", "data": {...}}           (as the monitor sees them, in order)
  keeper -> {"event": "down"}                                     (the cell has ended; its teardown runs)
  keeper -> {"event": "ended", "result": {...}, "signal": N}      (last: the cell is down, its teardown done;
                                                                   N: the keeper's SIGTERM or SIGHUP, else 0)
  relay  -> {"op": "kill"}                                        (the cell ends now: a stuck exec server, ...;
                                                                   sent once, never waited on)

Who ends with whom. The keeper hands over the exec server's channel and closes its own copy, so the relay's
close (``stop``, its last client gone) is what ends the exec server, and with it the cell, as before. The
relay's end (its connection closed: it exited or died) kills the cell: no cell runs on unserved. The
keeper's end (its connection closed before ``ended``) ends the relay's clients with "the cell's host ended
it", and the keeper's death takes the cell with it (PID 1's parent-death signal). The keeper waits for the
relay before it exits, so whoever reaps the host (a warm launcher, the client that started it) reaps both.

Trust: both are the host, root or the user, as before; the relay holds nothing of the cell but the exec
server's channel (no monitor source, no cgroup, no table), and the keeper no client's connection.
"""
from __future__ import annotations

import _socket
import collections
import marshal
import os
import sys
from typing import TYPE_CHECKING, Any

from ..errors import AgentcellError
from . import wire

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..cell.execd import Channel
    from ..supervise import Supervised


def socketpair() -> tuple[_socket.socket, _socket.socket]:
    """(keeper's end, relay's end), close-on-exec."""
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    return a, b


class Here:
    """The cell in this process (the host could not fork: it had threads): :class:`Supervised` as the
    relay's loop sees a cell."""

    signal = 0  # (a keeper's signal: none here; this process takes its own, see server.main)

    def __init__(self, sup: Supervised) -> None:
        from ..cell.execd import encoded

        self.sup = sup
        self.cell_id, self.pid1 = sup.cell_id, sup.pid1
        self.live: Channel = sup.running.live  # type: ignore[assignment]
        spec = sup.spec
        self.env = encoded(spec.environ())
        self.cwd = spec.cwd or spec.identity.home

    def fileno(self) -> int:
        return self.sup.running.fileno()

    def news(self) -> None:
        self.sup.running.poll_messages(0)

    def over(self) -> bool:
        return self.sup.running.reported() or self.sup.running.finished_reading()

    def down(self) -> bool:
        return self.over()

    def kill(self) -> None:
        self.sup.running.kill()

    def events_seen(self) -> int:
        return len(self.sup.events())

    def result(self) -> dict[str, Any]:
        return self.sup.finish(self.sup.running.wait(None, clean_up=False).as_dict())


class Relayed:
    """The cell as the relay sees it: its keeper's connection. ``on_event(kind, data)`` is told each of the
    monitor's events as it comes."""

    def __init__(self, ctl: _socket.socket, opened: dict[str, Any], channel: int,
                 on_event: Callable[[str, dict[str, Any]], None]) -> None:
        from ..cell.execd import Channel

        self.ctl, self.on_event = ctl, on_event
        self.cell_id, self.pid1 = str(opened["cell_id"]), int(opened["pid1"])
        self.env: dict[bytes, bytes] = dict(opened["env"])
        self.cwd = str(opened["cwd"])
        self.live = Channel(_socket.socket(fileno=channel))
        self._result: dict[str, Any] | None = None
        self.signal = 0  # the keeper ended the cell at this signal (the host was stopped: no linger)
        self._down = False  # the cell has ended (its teardown may still run in the keeper)
        self._killed = False
        self._events = 0
        self._buf = wire.buffer()

    def fileno(self) -> int:
        return self.ctl.fileno()

    def news(self) -> None:
        """One message of the keeper's."""
        if self._result is not None:
            return
        msg, fds = wire.recv_or_gone(self.ctl, self._buf)
        for fd in fds:
            os.close(fd)
        if msg is None:  # the keeper is gone without its end: so is the cell (PID 1's parent-death signal)
            self._result = {"error": "the cell's keeper (its host's other process) died"}
        elif msg.get("event") in ("escape", "note"):
            self._events += 1
            self.on_event(str(msg["event"]), msg["data"])
        elif msg.get("event") == "down":
            self._down = True
        elif msg.get("event") == "ended":
            self.signal = int(msg.get("signal") or 0)
            self._result = dict(msg.get("result") or {})

    def over(self) -> bool:
        return self._result is not None

    def down(self) -> bool:
        """The cell has ended: what its teardown takes is not the exec server's doing."""
        return self._down or self._result is not None

    def kill(self) -> None:
        """Once, without waiting: the relay's loop asks again on every pass while the cell lives on."""
        if self._killed:
            return
        try:
            self.ctl.sendmsg([marshal.dumps({"op": "kill"})], [], _socket.MSG_DONTWAIT)
            self._killed = True
        except BlockingIOError:
            pass  # (the keeper has not read what it was sent yet: the next pass asks again)
        except OSError:
            self._killed = True  # the keeper is gone: so is the cell

    def events_seen(self) -> int:
        return self._events

    def result(self) -> dict[str, Any]:
        while self._result is None:
            self.news()
        return self._result


def await_opened(ctl: _socket.socket) -> tuple[dict[str, Any] | None, int | None]:
    """The relay's first message from its keeper: ("opened" and the exec server's channel), or
    ("error", None), or (None, None) when the keeper died first."""
    msg, fds = wire.recv_or_gone(ctl)
    channel = None
    for fd in fds:
        if channel is None and msg is not None and msg.get("event") == "opened":
            channel = fd
        else:
            os.close(fd)
    if msg is not None and msg.get("event") == "opened" and channel is None:
        return {"event": "error", "field": "cell", "message": "cell: its exec server's channel did not come",
                "code": 123}, None
    if msg is not None and msg.get("event") not in ("opened", "error"):  # (the cell ended before it opened)
        return {"event": "error", "field": "cell", "message": "cell: the cell ended before it could be opened",
                "code": 123}, None
    return msg, channel


def keep(ctl: _socket.socket, msg: dict[str, Any], relay: int,
         trim: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> int:
    """The keeper: make the cell ``msg`` asks for (an ``open``), hand its exec server's channel to the relay,
    watch it to its end, take it down, and tell the relay; then wait for the relay. Returns the host's exit
    status. ``trim``: the message, then smaller versions of it, to send in turn until one fits
    (:func:`.server.attempts`)."""
    from ..cell.execd import encoded
    from ..cell.spec import spec_from_dict
    from ..errors import Terminated, held, termination_held
    from ..supervise import Supervised

    news: collections.deque[Any] = collections.deque()
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def on_event(ev: Any) -> None:  # (the monitor's thread: it never blocks on the relay)
        news.append(ev)
        try:
            os.write(wake_w, b"x")
        except OSError:
            pass

    def send(m: dict[str, Any], fds: list[int] | None = None) -> bool:
        for attempt in trim(m):
            try:
                wire.send(ctl, attempt, fds)
                return True
            except (wire.WireError, ValueError):  # (larger than the wire takes; marshal's own refusal)
                continue
            except OSError as e:
                if e.errno == 90:  # EMSGSIZE
                    continue
                return False  # the relay is gone
        return False

    def flush() -> None:
        while news:
            ev = news.popleft()
            send({"event": "escape" if ev.acts else "note", "data": ev.as_dict()})

    import signal

    code = signum = 0
    sup = None
    try:
        try:
            spec = spec_from_dict(msg["spec"])
            null = os.open(os.devnull, os.O_RDWR)
            try:
                give_to = msg.get("give_to")  # who gets what is moved aside: the client's human
                sup = Supervised.start(spec, [], monitor=msg.get("monitor"), callback=on_event,
                                       stdio=(null, null, null), live=True,
                                       give_to=(int(give_to[0]), int(give_to[1])) if give_to else None)
            finally:
                os.close(null)
        except AgentcellError as e:
            send({"event": "error", "field": e.field, "message": e.line(), "code": e.exit_code})
            return 1
        except (KeyError, TypeError, ValueError) as e:
            send({"event": "error", "field": "request", "message": f"request: malformed: {e}", "code": 125})
            return 1
        running = sup.running
        live, running.live = running.live, None
        assert live is not None
        try:
            spec = sup.spec
            relay_alive = send({"event": "opened", "cell_id": sup.cell_id, "pid1": sup.pid1,
                                "env": encoded(spec.environ()), "cwd": spec.cwd or spec.identity.home},
                               [live.sock.fileno()])
        finally:
            live.sock.close()  # (close, not shutdown: the relay's copy is the same socket)
        if not relay_alive:
            running.kill()
        while not (running.reported() or running.finished_reading()):
            for r in wire.ready([running, wake_r, *([ctl] if relay_alive else [])], None):
                if r is running:
                    running.poll_messages(0)
                elif r == wake_r:
                    try:
                        os.read(wake_r, 4096)
                    except OSError:
                        pass
                else:
                    got, fds = wire.recv_or_gone(ctl)
                    for fd in fds:
                        os.close(fd)
                    if got is None:  # the relay has gone: no client is served, the cell ends (fail closed)
                        relay_alive = False
                        running.kill()
                    elif got.get("op") == "kill":
                        running.kill()
            if relay_alive:
                flush()
        if relay_alive:
            send({"event": "down"})  # (its teardown may take a while: the relay must not take it for a hang)
    except Terminated as e:  # SIGTERM or SIGHUP: the cell goes down, as ``stop`` would take it
        code, signum = 128 + e.signum, e.signum
        if sup is not None:
            sup.running.kill()
    except BaseException:  # a bug of ours: the cell goes down all the same, and the error is seen
        if sup is not None:
            sup.running.kill()
        raise
    finally:
        if sup is not None:
            # The teardown runs whole, whatever signal comes meanwhile (one that came is taken after it:
            # not by a mask, which Python's handlers, run in this thread for any thread's signal, ignore).
            try:
                with held():
                    result = sup.finish(sup.running.wait(None, clean_up=False).as_dict())
                    flush()  # (the monitor's last look)
                    came = termination_held()
                    if came and not signum:
                        code, signum = 128 + came, came
                    send({"event": "ended", "result": result, "signal": signum})
            except Terminated as e:  # (it came after the relay was told: the relay is told now)
                if isinstance(e.__context__, Exception):  # (the teardown failed too: a bug of ours, seen)
                    sys.stderr.write(f"agentcell cell host: the cell's teardown failed: {e.__context__!r}\n")
                if not signum:
                    code, signum = 128 + e.signum, e.signum
                    try:
                        os.kill(relay, signal.SIGTERM)
                    except OSError:
                        pass
        ctl.close()
        for fd in (wake_r, wake_w):
            os.close(fd)
        code = _reap(relay) or code
    return code


def _reap(pid: int) -> int:
    """Wait for the relay (a named cell's lingers after the end). A SIGTERM or SIGHUP meanwhile is passed
    on to it (it stops lingering and removes its socket) and makes this host's status 128+N."""
    import signal

    from ..errors import Terminated

    code = 0
    while True:
        try:
            os.waitpid(pid, 0)
            return code
        except InterruptedError:
            continue
        except ChildProcessError:
            return code
        except Terminated as e:
            code = 128 + e.signum
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
