"""What a failed call means (agentcell.monitor.attempts), decided from the cell's view and what the host
has. The host here is a stand-in (FakeHost): which paths, sockets, pids and listeners exist is the test's
to say; the cell's view is built from a real CellSpec as the launcher would build it."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from agentcell.cell.spec import CellSpec, Identity
from agentcell.monitor.attempts import Classifier, Host, View
from agentcell.monitor.callprog import AT_FDCWD, CALLS
from agentcell.monitor.calls import Call, TaskEvent
from agentcell.monitor.callsource import AttemptSource
from agentcell.monitor.pidns import EXIT, FORK, GONE_TIDS, RECENT_NS, Numbers

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

    def cwd(self, pid: int, tid: int = 0) -> str | None:
        return self.where

    def fd_path(self, pid: int, fd: int, tid: int = 0) -> str | None:
        return None

    def resolve(self, path: str, pid: int = 0, tid: int = 0, owned: object = None) -> str | None:
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


def classifier(host: FakeHost, *, network: str = "none", lost: bool = False,
               guarded: tuple[tuple[str, bool], ...] = (), masked: tuple[str, ...] = (),
               refused: list[tuple[str, int]] | None = None) -> Classifier:
    spec = CellSpec(Identity("agent", 1_900_000_001, 1_900_000_001, "ac-s1", HOME), rw_paths=(PROJECT,),
                    masked_paths=masked, network=network)  # type: ignore[arg-type]
    sink = refused if refused is not None else []
    return Classifier(View(spec, guarded, ()), network, host, lambda: lost,
                      lambda target, pid: sink.append((target, pid)))


def call(name: str, errno: int, path: str = "", *, path2: str = "", flags: int = 0, addr: Any = None,
         pid_arg: int = 0, args: tuple[int, ...] = (), at: int = 0) -> Call:
    """A failed call; ``at``: the kernel's clock when it failed (ns)."""
    raw = [*args, *[0] * (6 - len(args))]
    if name in ("openat", "openat2", "mkdirat", "unlinkat"):
        raw[0], raw[2] = AT_FDCWD & 0xFFFFFFFFFFFFFFFF, flags
    elif name == "open":
        raw[1] = flags
    if name in ("kill", "pidfd_open"):
        raw[0] = pid_arg
    assert name in CALLS
    return Call(name, errno, 1234, 1234, "tool", tuple(raw), path, path2, addr, ktime=at)


def lived(c: Classifier, number: int, born: int, ended: int | None = None, tid: int = 0) -> None:
    """One of the cell's tasks had ``number`` in its pid namespace from ``born`` (to ``ended``), by the clock."""
    c.numbers.task(FORK, number, tid or 100_000 + number, born)
    if ended is not None:
        c.numbers.task(EXIT, number, tid or 100_000 + number, ended)


O_WRONLY, O_CREAT = 1, 0o100


def verdict(c: Classifier, k: Call) -> tuple[str, str, bool] | None:
    v = c.classify(k)
    return None if v is None else (v[0], v[1], v[3])


def acts(c: Classifier, k: Call) -> bool | None:
    """Whether it acts (True), is a note (False) or is nothing (None)."""
    v = c.classify(k)
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


S = 10**9  # a second of the kernel's clock


def test_a_host_process_through_proc_acts_unless_the_number_was_the_cells_when_it_was_looked_at() -> None:
    c = classifier(FakeHost(pids={7, 8, 4242}))
    assert acts(c, call("openat", ENOENT, "/proc/4242/environ", at=5 * S)) is True  # never the cell's
    assert acts(c, call("openat", ENOENT, "/proc/9999/stat", at=5 * S)) is None  # no such process anywhere
    assert acts(c, call("openat", ENOENT, "/proc/²/environ", at=5 * S)) is None  # (a digit to str.isdigit only)
    # one of its own that just ended (ps listing /proc, a parent looking at its child): a note, not an escape
    lived(c, 7, S, 5 * S)
    assert verdict(c, call("openat", ENOENT, "/proc/7/stat", at=5 * S + 1)) == ("read", "/proc/7", False)
    assert acts(c, call("openat", ENOENT, "/proc/7/cwd", at=5 * S + RECENT_NS)) is False
    # long after: a look at whether it runs (a pidfile's check) is still its own business; a reach is not
    assert acts(c, call("openat", ENOENT, "/proc/7/status", at=5 * S + RECENT_NS + 1)) is False
    assert acts(c, call("openat", ENOENT, "/proc/7", at=5 * S + RECENT_NS + 1)) is False
    assert acts(c, call("openat", ENOENT, "/proc/7/cwd", at=5 * S + RECENT_NS + 1)) is True
    assert acts(c, call("openat", ENOENT, "/proc/7/environ", at=5 * S + RECENT_NS + 1)) is True
    # alive when the call was made (it ended since): the ENOENT was about a name below it
    lived(c, 8, S, 9 * S)
    assert acts(c, call("openat", ENOENT, "/proc/8/fd/99", at=8 * S)) is None
    # a signal or a pidfd for a host process: a note; for a number of its own, however long ago, nothing
    assert acts(c, call("kill", ESRCH, pid_arg=4242, at=6 * S)) is False
    assert acts(c, call("kill", ESRCH, pid_arg=7, at=6 * S)) is None
    assert acts(c, call("pidfd_open", ESRCH, pid_arg=7, at=60 * S)) is None


def test_a_number_the_cell_takes_only_after_the_look_is_the_hosts_at_the_look() -> None:
    # the look fails (no such number in the cell), then a thread takes that number: still a host process's
    c = classifier(FakeHost(pids={1157}))
    lived(c, 1157, 5 * S + 1)
    assert acts(c, call("openat", ENOENT, "/proc/1157/status", at=5 * S)) is True


def test_whose_number_it_is_never_depends_on_how_the_hosts_pids_compare_with_the_cells() -> None:
    # (a fresh host's pids are as low as the cell's; a host past pid_max starts low again; a cell that forked
    # more than pid_max times has had every number): what the cell's namespace did with it, and when, decides
    c = classifier(FakeHost(pids={3, 301, 32000}))
    for n in range(5, 32768, 97):  # a busy cell: numbers given up all over the range, long ago
        lived(c, n, S, S)
    lived(c, 301, 99 * S, 100 * S)  # ... and 301 just now
    assert acts(c, call("openat", ENOENT, "/proc/3/cwd", at=100 * S)) is True  # never the cell's
    assert acts(c, call("openat", ENOENT, "/proc/32000/cwd", at=100 * S)) is True
    assert acts(c, call("openat", ENOENT, "/proc/301/cwd", at=100 * S)) is False
    assert acts(c, call("openat", ENOENT, f"/proc/{5 + 97}/cwd", at=100 * S)) is None  # not a host pid


def test_a_number_that_cannot_be_told_is_a_note() -> None:
    # the kernel dropped some of the cell's task events: a note, never an escape
    assert acts(classifier(FakeHost(pids={4242}), lost=True), call("openat", ENOENT, "/proc/4242/maps")) is False
    # a kernel that does not say what number a task had
    c = classifier(FakeHost(pids={4242}))
    c.numbers.task(EXIT, 0, 9, S)
    assert acts(c, call("openat", ENOENT, "/proc/4242/maps", at=2 * S)) is False


def test_a_thread_that_execs_gives_its_own_number_up_and_takes_its_leaders() -> None:
    n = Numbers()
    n.task(FORK, 3, 503, S)  # the process (host tid 503 is its leader)
    n.task(FORK, 5, 505, 2 * S)  # one of its threads
    n.task(EXIT, 3, 503, 3 * S)  # the thread calls exec: the kernel ends the leader ...
    n.exec_by(505, 503, 3 * S + 1)  # ... and the thread goes on as the process, under the leader's number
    assert n.state(3, 4 * S) == "alive" and n.state(5, 4 * S) == "ended"
    assert n.state(5, 4 * S + RECENT_NS + 1) == "had"


def test_what_the_cell_did_with_its_numbers_stays_bounded() -> None:
    n = Numbers()
    for i in range(200_000):  # threads made and ended as fast as a cell can, 20 a millisecond, for 10 s
        n.task(FORK, 300 + i % 30_000, 10**6 + i, S + i * 50_000)
        n.task(EXIT, 300 + i % 30_000, 10**6 + i, S + i * 50_000 + 1)
    assert len(n.live) == 0 and len(n.ended) == len(n.first) == 30_000 and len(n._ends) <= 61_024
    assert len(n.gone_tids) <= GONE_TIDS
    assert n.state(300, S + 200_000 * 50_000) == "ended" and n.state(29_999, S) == "never"


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


def test_the_source_reads_the_tasks_before_it_tells_the_calls_apart() -> None:
    c = classifier(FakeHost(pids={33, 4242}))

    class Ring:
        def __init__(self, calls: list[Call], tasks: list[TaskEvent]) -> None:
            self.calls, self.tasks = calls, tasks

        def read(self) -> list[Call]:
            out, self.calls = self.calls, []
            return out

        def read_tasks(self) -> list[TaskEvent]:
            out, self.tasks = self.tasks, []
            return out

    # (the task ring is read after the calls: a task that ended before a call is always there by then)
    ring = Ring([call("openat", ENOENT, "/proc/33/stat", at=S + 1),
                 call("openat", ENOENT, "/proc/4242/stat", at=S + 2)],
                [TaskEvent(FORK, 33, 633, 633, S - 5), TaskEvent(EXIT, 33, 633, 633, S)])
    source = AttemptSource(ring, c, "cell", lambda pid: "/usr/bin/ps", lambda pid: False, lambda *a: None)
    assert [(e.target, e.acts, e.exe) for e in source.read()] == [("/proc/33", False, "/usr/bin/ps"),
                                                                 ("/proc/4242/stat", True, "/usr/bin/ps")]


def test_raw_packet_and_icmp_sockets_refused_and_writes_to_sys_and_devices_the_cell_lacks_are_recorded() -> None:
    c = classifier(FakeHost({"/dev/ttyUSB0", "/dev/mem"}))
    c.host.is_device = lambda path: path in ("/dev/ttyUSB0", "/dev/mem")  # type: ignore[method-assign]
    sock = {k: call("socket", e, args=a) for k, e, a in (
        ("raw", EPERM, (2, 3 | 0o2000000, 1)), ("icmp", EACCES, (2, 2, 1)), ("icmp6", EACCES, (10, 2, 58)),
        ("packet", EPERM, (17, 3, 0x300)), ("tcp", EACCES, (2, 1, 0)), ("unix", EPERM, (1, 1, 0)))}
    assert verdict(c, sock["raw"]) == ("network", "socket inet raw", False)
    assert verdict(c, sock["icmp"]) == ("network", "socket inet icmp", False)
    assert verdict(c, sock["icmp6"]) == ("network", "socket inet6 icmp", False)
    assert verdict(c, sock["packet"]) == ("network", "socket packet", False)
    assert verdict(c, sock["tcp"]) is None and verdict(c, sock["unix"]) is None
    # /sys: a write is a kernel setting or a control group (the cell has no /sys); a look is nothing
    assert verdict(c, call("mkdir", ENOENT, "/sys/fs/cgroup/x")) == ("write", "/sys/fs/cgroup/x", True)
    assert acts(c, call("openat", ENOENT, "/sys/kernel/mm/ksm/run", flags=O_WRONLY)) is True
    assert acts(c, call("mkdir", EROFS, "/sys")) is True
    assert verdict(c, call("openat", ENOENT, "/sys/fs/cgroup/cpu.max")) is None
    # (a runtime's trace markers: Bun opens one for writing at every start)
    assert verdict(c, call("openat", ENOENT, "/sys/kernel/debug/tracing/trace_marker", flags=O_WRONLY)) is None
    # a device the cell does not have: a host device that reads beneath every wall acts, another is a note
    assert verdict(c, call("openat", ENOENT, "/dev/mem")) == ("read", "/dev/mem", True)
    assert verdict(c, call("openat", ENOENT, "/dev/ttyUSB0")) == ("read", "/dev/ttyUSB0", False)
    assert verdict(c, call("openat", ENOENT, "/dev/not-there")) is None


def test_the_root_of_a_cell_task_gone_since_the_call_is_the_cells_root(tmp_path: Path) -> None:
    """The monitor reads a failed call after the fact; under load, after its process (or the whole cell) has
    ended, when the cell's /proc no longer has it: /proc/N/root of a task the cell had at the call still
    leads to the cell's root (no task of a cell can chroot). CI saw the probe's look through its own
    /proc/N/root go unreported once; a number the cell never had stays a look at a host process."""
    from agentcell.monitor.cellview import Host as RealHost

    (tmp_path / "proc").mkdir()
    (tmp_path / "tmp").mkdir()
    host = RealHost()
    host.root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        path = "/proc/7/root/tmp/agentcell-escape-x/cwd/notes.txt"
        assert host.resolve(path, 7, 7, lambda n: n == 7) == "/tmp/agentcell-escape-x/cwd/notes.txt"
        assert host.resolve(path, 7, 7, lambda n: False) == path
        assert host.resolve(path, 7, 7) == path
        assert host.resolve("/proc/7/cwd/notes.txt", 7, 7, lambda n: True) == "/proc/7/cwd/notes.txt"
        # task 8 is there, exiting: its root link no longer reads (here: not a link at all)
        (tmp_path / "proc" / "8").mkdir()
        (tmp_path / "proc" / "8" / "root").write_text("")
        assert host.resolve("/proc/8/root/tmp/x", 8, 8) == "/tmp/x"
    finally:
        os.close(host.root_fd)
