"""What a failed call means (agentcell.monitor.attempts), decided from the cell's view and what the host
has. The host here is a stand-in (FakeHost): which paths, sockets, pids and listeners exist is the test's
to say; the cell's view is built from a real CellSpec as the launcher would build it."""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

from agentcell.cell.spec import CellSpec, Identity
from agentcell.monitor.attempts import AttemptSource, Classifier, Host, Later, View
from agentcell.monitor.calls import AT_FDCWD, CALLS, Call

PROJECT = "/home/human/proj"
HOME = "/home/ac-s1"
ENOENT, EPERM, ESRCH, EACCES, EBUSY, EXDEV, EROFS = 2, 1, 3, 13, 16, 18, 30
ENETUNREACH, ECONNREFUSED, EINPROGRESS = 101, 111, 115


class FakeHost(Host):
    def __init__(self, paths: Iterable[str] = (), sockets: Iterable[str] = (), pids: Iterable[int] = (),
                 listening: Iterable[int] = (), cell_listening: Iterable[int] = (), abstract: Iterable[str] = (),
                 links: dict[str, str] | None = None, cwd: str = PROJECT) -> None:
        super().__init__(pid1=1)
        self.paths, self.sockets, self.pids = set(paths) | set(sockets), set(sockets), set(pids)
        self.listening, self.cell_listening, self.names = set(listening), set(cell_listening), set(abstract)
        self.links, self.where = links or {}, cwd

    def exists(self, path: str) -> bool:
        return path in self.paths

    def is_socket(self, path: str) -> bool:
        return path in self.sockets

    def homes(self) -> set[str]:
        return {"/root", "/home/human", "/home/alice"}

    def pid_exists(self, pid: int) -> bool:
        return pid in self.pids

    def listens(self, port: int, *, cell: bool = False) -> bool:
        return port in (self.cell_listening if cell else self.listening)

    def abstract(self, name: str) -> bool:
        return name in self.names

    def cwd(self, pid: int) -> str | None:
        return self.where

    def fd_path(self, pid: int, fd: int) -> str | None:
        return None

    def resolve(self, path: str) -> str | None:
        """The walk of the real Host, over the test's links (every other name taken to be there)."""
        todo, at = [p for p in path.split("/") if p], "/"
        while todo:
            part = todo.pop(0)
            if part == "..":
                at = os.path.dirname(at)
            elif part != ".":
                here = os.path.join(at, part)
                if here in self.links:
                    target = self.links[here]
                    at = "/" if target.startswith("/") else at
                    todo[:0] = [p for p in target.split("/") if p]
                else:
                    at = here
        return at

    def resolvers(self) -> set[str]:
        return {"10.0.0.53"}

    def exists_in_cell(self, path: str) -> bool:
        return False


def classifier(host: FakeHost, *, network: str = "none", ceiling: int | None = 50,
               guarded: tuple[tuple[str, bool], ...] = (), masked: tuple[str, ...] = (),
               refused: list[tuple[str, int]] | None = None) -> Classifier:
    spec = CellSpec(Identity("agent", 1_900_000_001, 1_900_000_001, "ac-s1", HOME), rw_paths=(PROJECT,),
                    masked_paths=masked, network=network)  # type: ignore[arg-type]
    sink = refused if refused is not None else []
    return Classifier(View(spec, guarded, ()), network, host, lambda: ceiling,
                      lambda target, pid: sink.append((target, pid)))


def call(name: str, errno: int, path: str = "", *, path2: str = "", flags: int = 0, addr: Any = None,
         pid_arg: int = 0) -> Call:
    args = [0] * 6
    if name in ("openat", "openat2", "mkdirat", "unlinkat"):
        args[0], args[2] = AT_FDCWD & 0xFFFFFFFFFFFFFFFF, flags
    elif name == "open":
        args[1] = flags
    if name in ("kill", "pidfd_open"):
        args[0] = pid_arg
    assert name in CALLS
    return Call(name, errno, 1234, 1234, "tool", tuple(args), path, path2, addr)


O_WRONLY, O_CREAT = 1, 0o100


def verdict(c: Classifier, k: Call) -> tuple[str, str, bool] | None:
    v = c.classify(k)
    return None if v is None else (v[0], v[1], v[3])


def acts(c: Classifier, k: Call, *, final: bool = False) -> bool | str | None:
    """Whether it acts (True), is a note (False), is nothing (None), or waits for the connector ("later")."""
    c.final = final
    try:
        v = c.classify(k)
    except Later:
        return "later"
    finally:
        c.final = False
    return None if v is None else v[3]


def test_a_host_file_the_cell_does_not_contain_acts_when_it_exists_on_the_host() -> None:
    c = classifier(FakeHost({"/home/alice/notes.txt", "/srv/app/config.yml"}))
    assert verdict(c, call("openat", ENOENT, "/home/alice/notes.txt")) == ("read", "/home/alice/notes.txt", True)
    assert verdict(c, call("openat", ENOENT, "/srv/app/config.yml")) == ("read", "/srv/app/config.yml", True)
    assert verdict(c, call("openat", ENOENT, "/srv/nothing-there")) is None  # nothing to reach


def test_a_credential_in_a_home_acts_whether_it_exists_or_not() -> None:
    c = classifier(FakeHost())
    assert acts(c, call("openat", ENOENT, "/home/human/.ssh/id_ed25519")) is True
    assert acts(c, call("openat", ENOENT, "/root/.aws/credentials")) is True
    assert verdict(c, call("openat", ENOENT, "/home/human/todo.txt")) is None  # next to the project, not there


def test_a_name_next_to_the_project_is_a_note_tools_look_for_their_config_in_parents() -> None:
    c = classifier(FakeHost({"/home/human/package.json", "/home/human/other-repo", "/home/human/other-repo/a.py"}))
    assert verdict(c, call("openat", ENOENT, "/home/human/package.json")) == ("read", "/home/human/package.json",
                                                                              False)
    assert acts(c, call("openat", ENOENT, "/home/human/other-repo")) is False
    # deeper than a name beside the project: a sibling repository's file
    assert acts(c, call("openat", ENOENT, "/home/human/other-repo/a.py")) is True
    # another account's home itself, beside the cell's ancestors: acts
    c2 = classifier(FakeHost({"/home/alice"}))
    assert acts(c2, call("openat", ENOENT, "/home/alice")) is True


def test_what_software_probes_by_itself_is_nothing() -> None:
    c = classifier(FakeHost({"/sys/devices/system/cpu/online", "/var/lib/dbus/machine-id", "/run/systemd/userdb"}))
    for path in ("/sys/devices/system/cpu/online", "/var/lib/dbus/machine-id", "/run/user/1900000001/bus"):
        assert verdict(c, call("openat", ENOENT, path)) is None, path
    assert verdict(c, call("openat", ENOENT, "/usr/lib/locale/C.UTF-8/LC_CTYPE")) is None  # the system as it is
    assert acts(c, call("openat", ENOENT, "/var/tmp")) is False


def test_writes_outside_act_writes_refused_inside_the_declared_paths_are_notes() -> None:
    guarded = ((f"{PROJECT}/.git/hooks", True), (f"{PROJECT}/AGENTS.md", True), (f"{PROJECT}/.git", False))
    c = classifier(FakeHost({"/home/human"}), guarded=guarded)
    assert acts(c, call("openat", EROFS, "/usr/local/bin/x", flags=O_WRONLY | O_CREAT)) is True
    assert acts(c, call("mkdir", EROFS, "/home/human/x")) is True
    assert verdict(c, call("openat", EROFS, "/usr/lib/python3/dist-packages/__pycache__/a.cpython-311.pyc",
                           flags=O_WRONLY | O_CREAT)) is None  # Python caching byte code: it copes
    hook = verdict(c, call("openat", EROFS, f"{PROJECT}/.git/hooks/pre-commit", flags=O_WRONLY | O_CREAT))
    assert hook == ("write", f"{PROJECT}/.git/hooks/pre-commit", False)
    assert acts(c, call("openat", EROFS, f"{PROJECT}/AGENTS.md", flags=O_WRONLY)) is False
    assert acts(c, call("rename", EBUSY, f"{PROJECT}/.git", path2=f"{PROJECT}/.git-old")) is False
    # a missing file in the project is ordinary work
    assert verdict(c, call("openat", ENOENT, f"{PROJECT}/src/missing.py")) is None


def test_a_host_secret_masked_acts_a_masked_env_file_of_the_project_is_a_note() -> None:
    c = classifier(FakeHost(), masked=(f"{PROJECT}/.env",))
    assert verdict(c, call("openat", EACCES, "/etc/shadow")) == ("read", "/etc/shadow", True)
    assert verdict(c, call("openat", EACCES, f"{PROJECT}/.env")) == ("read", f"{PROJECT}/.env", False)


def test_a_host_process_through_proc_acts_only_above_what_the_cell_could_have_had() -> None:
    c = classifier(FakeHost(pids={7, 4242}), ceiling=50)
    # (no kernel count in the event: the fork count alone, once the connector has had its time)
    assert acts(c, call("openat", ENOENT, "/proc/4242/environ")) == "later"
    assert acts(c, call("openat", ENOENT, "/proc/4242/environ"), final=True) is True
    # a number the cell may have had (one of its own that just exited): a note, not an escape
    assert acts(c, call("openat", ENOENT, "/proc/7/stat")) is False
    assert acts(c, call("openat", ENOENT, "/proc/9999/stat")) is None  # no such process anywhere
    assert acts(classifier(FakeHost(pids={4242}), ceiling=None), call("openat", ENOENT, "/proc/4242/maps")) is False
    assert acts(c, call("openat", ENOENT, "/proc/²/environ")) is None  # (a digit to str.isdigit, not to int)
    assert acts(c, call("kill", ESRCH, pid_arg=4242)) is False


def test_the_kernels_last_pid_says_never_the_cells_and_the_connector_says_maybe() -> None:
    count = [5]
    lagging = Classifier(classifier(FakeHost()).view, "none", FakeHost(pids={33, 4242, 23286}), lambda: count[0])

    def probe(pid: int, last: int | None) -> Call:
        k = call("openat", ENOENT, f"/proc/{pid}/stat")
        k.last_pid = last
        return k

    # Above the kernel's count when the call failed: a host process, at once.
    assert acts(lagging, probe(4242, 40)) is True
    # Between the connector's count and the kernel's: a child not handed over yet (ps in a busy cell) ...
    assert acts(lagging, probe(33, 40)) == "later"
    count[0] = 36  # ... which the connector names on the next pass: one of the cell's, a note
    assert acts(lagging, probe(33, 40)) is False
    # ... or numbers burnt by forks that failed (no process made, nothing the connector hears of): the
    # count alone decides once the wait is over; the kernel's count never makes a host pid the cell's.
    count[0] = 5
    assert acts(lagging, probe(23286, 24002)) == "later"
    assert acts(lagging, probe(23286, 24002), final=True) is True
    # the connector's count lost (it overflowed): the kernel's count still tells a host process
    lost = Classifier(lagging.view, "none", FakeHost(pids={33, 4242}), lambda: None)
    assert acts(lost, probe(4242, 40)) is True and acts(lost, probe(33, 40)) is False
    # a namespace that went round pid_max: the kernel's count starts low again, the fork count stands
    count[0] = 50
    assert acts(lagging, probe(33, 3)) is False
    assert acts(lagging, probe(4242, 3)) == "later"


def test_the_network_outside_acts_dns_to_the_hosts_resolver_and_the_hosts_own_ports_are_notes() -> None:
    c = classifier(FakeHost(listening={5432, 8000}, cell_listening={8000}))
    assert verdict(c, call("sendto", ENETUNREACH, addr=("inet", "198.18.0.9", 8081))) == \
        ("network", "198.18.0.9:8081", True)
    assert acts(c, call("sendto", ENETUNREACH, addr=("inet", "10.0.0.53", 53))) is False  # libc's own query
    assert acts(c, call("sendto", ENETUNREACH, addr=("inet", "198.18.0.9", 53))) is True  # DNS-shaped, elsewhere
    assert acts(c, call("connect", ECONNREFUSED, addr=("inet", "127.0.0.1", 5432))) is False
    assert verdict(c, call("connect", EINPROGRESS, addr=("inet", "127.0.0.1", 8000))) is None  # its own server
    assert verdict(c, call("connect", ECONNREFUSED, addr=("inet", "127.0.0.1", 9))) is None  # nothing listens there
    assert verdict(c, call("connect", EACCES, addr=("inet", "10.0.0.1", 443))) is None  # Landlock's record says it


def test_on_the_hosts_network_a_refused_connect_only_names_who_tried() -> None:
    refused: list[tuple[str, int]] = []
    c = classifier(FakeHost(), network="host-firewall", refused=refused)
    assert verdict(c, call("connect", ECONNREFUSED, addr=("inet6", "fd00::1", 22))) is None
    assert refused == [("[fd00::1]:22", 1234)]


@pytest.mark.parametrize(("addr", "host", "want"), [
    (("unix", "/var/run/docker.sock"), FakeHost(sockets={"/var/run/docker.sock"}), True),
    (("unix", "/var/run/nscd/socket"), FakeHost(sockets={"/var/run/nscd/socket"}), None),  # libc asks, copes
    (("unix", "/run/nothing.sock"), FakeHost(), None),
    # any host account can bind an abstract name, or a socket in /tmp: noted, or an outsider could end the cell
    (("abstract", "/tmp/.X11-unix/X0"), FakeHost(abstract={"/tmp/.X11-unix/X0"}), False),
    (("unix", "/tmp/tmux-1900000001/default"), FakeHost(sockets={"/tmp/tmux-1900000001/default"}), False),
    (("abstract", "never-there"), FakeHost(), None),
])
def test_a_socket_of_a_host_service_acts(addr: tuple[str, str], host: FakeHost, want: bool | None) -> None:
    errno = ENOENT if addr[0] == "unix" else ECONNREFUSED
    assert acts(classifier(host), call("connect", errno, addr=addr)) is want


def test_a_link_is_followed_where_it_stands_and_dot_dot_after_it() -> None:
    host = FakeHost({"/home/human/.ssh/id_ed25519", "/srv/secret.env"},
                    links={f"{PROJECT}/key": "/home/human/.ssh/id_ed25519", f"{PROJECT}/mine": "src/other.py",
                           f"{PROJECT}/up": f"{PROJECT}/a/b"})
    c = classifier(host)
    v = c.classify(call("openat", ENOENT, f"{PROJECT}/key"))
    assert v is not None and v[1] == "/home/human/.ssh/id_ed25519" and v[3] is True and "named as" in v[2]
    assert c.classify(call("openat", ENOENT, f"{PROJECT}/mine")) is None  # a link within the project
    # ".." after a link is taken from where the link led (the kernel's walk), not from its name
    v = c.classify(call("openat", ENOENT, f"{PROJECT}/up/../../../../../srv/secret.env"))
    assert v is not None and v[1] == "/srv/secret.env" and v[3] is True, v
    assert acts(c, call("openat", ENOENT, "/usr/../srv/secret.env")) is True


def test_calls_whose_first_path_is_empty_or_whose_flags_are_behind_a_pointer() -> None:
    c = classifier(FakeHost({"/home/human"}))
    assert acts(c, call("linkat", EROFS, "", path2="/usr/bin/planted")) is True  # AT_EMPTY_PATH: the fd itself
    k = call("openat2", ENOENT, "/home/human/planted.txt")
    k.flags = O_WRONLY | O_CREAT  # openat2's open_how, read by the program
    assert acts(c, k) is True
    assert acts(c, call("bind", EROFS, addr=("unix", "/usr/lib/x.sock"))) is True


def test_a_relative_path_is_read_from_where_the_process_stands() -> None:
    c = classifier(FakeHost({"/home/alice/notes.txt"}, cwd="/home"))
    assert verdict(c, call("openat", ENOENT, "alice/notes.txt")) == ("read", "/home/alice/notes.txt", True)
    assert acts(classifier(FakeHost({"/home/alice/notes.txt"}, cwd=PROJECT)),
                call("openat", ENOENT, "../../alice/notes.txt")) is True


def test_a_top_level_directory_looked_at_and_a_lock_in_a_read_only_cache_are_notes() -> None:
    c = classifier(FakeHost({"/var", "/root"}))
    assert acts(c, call("openat", ENOENT, "/var")) is False
    assert acts(c, call("openat", ENOENT, "/root")) is True  # a home
    assert acts(c, call("mkdir", EROFS, "/var")) is True  # a write
    assert acts(c, call("openat", EROFS, "/opt/tool/pkg/inuse.20.lock", flags=O_WRONLY | O_CREAT)) is False


def test_a_call_that_waits_for_the_connector_is_decided_on_a_later_pass_or_at_the_end() -> None:
    count = [5]
    c = Classifier(classifier(FakeHost()).view, "none", FakeHost(pids={33, 4242}), lambda: count[0])

    class Ring:
        def __init__(self) -> None:
            self.calls: list[Call] = []

        def read(self) -> list[Call]:
            out, self.calls = self.calls, []
            return out

    ring = Ring()
    source = AttemptSource(ring, c, "cell", lambda pid: "/usr/bin/ps", lambda pid: False, lambda *a: None)
    child, host = call("openat", ENOENT, "/proc/33/stat"), call("openat", ENOENT, "/proc/4242/stat")
    child.last_pid = host.last_pid = 40
    ring.calls = [child, host]
    got = source.read()  # the host pid above the kernel's count acts at once; the child waits
    assert [(e.target, e.acts) for e in got] == [("/proc/4242/stat", True)] and source.pending
    assert source.read() == [] and source.pending  # the connector has not named it yet
    count[0] = 36
    assert [(e.target, e.acts) for e in source.read()] == [("/proc/33", False)] and not source.pending
    count[0] = 5
    ring.calls = [call("openat", ENOENT, "/proc/33/stat")]  # (no kernel count: the fork count, at the end)
    assert source.read() == [] and source.pending
    assert [(e.target, e.acts) for e in source.flush()] == [("/proc/33/stat", True)] and not source.pending
