"""What a failed call means: an attempt to leave the cell (it acts), a note (recorded: ordinary software
touches it and copes), or nothing (ordinary work). Decided from the cell's own view (its mount tree,
as the launcher built it from the spec and the protected entries) and what exists on the host.

Acting (outside the declared paths and the allow-list), each with the path or address as the process
named it:

* a host path the cell does not contain: the homes of the host's accounts and ``/root`` (what exists
  there, and any credential's name whether it exists or not), any other host path outside the declared
  ones that exists on the host (a sibling repository, ``/srv``, ``/var/lib/…``), a host socket;
* a secret of the host the cell masks (``/etc/shadow``: its mask is an empty mode-000 file);
* a write to the read-only system or to a path the cell does not contain;
* a host process through ``/proc`` (a number a host process has that the cell's namespace has not given up
  in the last moments), a kernel setting (``/proc/sys``, ``/sys``, a control group), the kernel's log or
  memory;
* a device of the host (a disk, memory, a console);
* a connection or datagram to an address outside the cell (``--net none``, ``loopback``, ``proxy``), DNS
  to anything but the host's own resolver included;
* a socket of a host service the cell does not contain (outside the temporary directories every account
  shares).

Paths are taken as the kernel walked them in the cell (links followed where they stand, ``..`` after
them), not as written.

Notes: what is refused inside the declared paths (a write to a protected entry of the project, a git
hook or ``.claude/settings.json``, read-only binds: EROFS; to a ``--ro`` path; a read of a ``--mask``ed
``.env``), what software does on its own and copes with when it fails, what any account of the host could
set up to make a tool of the cell fail (an abstract socket, a socket in ``/tmp``), or what says nothing
alone: a DNS query to the host's resolver (the cell has none: names are resolved by the proxy); a port
the host listens on, tried on the cell's own loopback; a name next to the project outside the cell (tools
look for their config in parent directories); a top-level host directory looked at; a host pid signalled,
or a ``/proc`` number the cell gave up a moment ago; a raw, packet or ICMP socket refused (ping); another
device of the host that the cell's ``/dev`` lacks; a hard link across mounts; a lock file in a read-only
cache; a name of the host's shared ``/tmp`` that the cell's own ``/tmp`` lacks (a tool's cache of a fixed
name; credentials there act).

Nothing: missing files inside the cell's own view (the cell sees those trees as they are), ``/sys``,
the system services' sockets and files every libc or toolkit probes (nscd, journald, D-Bus, the machine
id), a runtime directory of the cell's own account, Python's byte-code caches in the read-only system.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from .callprog import AT_FDCWD, DIRFD, DIRFD2, O_ACCMODE, O_CREAT, O_TRUNC
from .calls import Call
from .cellview import Host as Host  # (re-exported: the supervisor builds the View it is read against)
from .cellview import View as View
from .pidns import Numbers

ENOENT, EPERM, ESRCH, EACCES, EBUSY, EXDEV, EROFS = 2, 1, 3, 13, 16, 18, 30
ENETUNREACH, ECONNREFUSED, EHOSTUNREACH, EADDRNOTAVAIL, EINPROGRESS = 101, 111, 113, 99, 115

# A path with one of these components names a credential (a key, a token store, a shell's history).
CREDENTIALS = frozenset({
    ".ssh", ".aws", ".gnupg", ".netrc", ".git-credentials", ".docker", ".kube", ".pgpass", ".npmrc", ".pypirc",
    ".vault-token", ".password-store", ".azure", ".gcloud", ".terraform.d", ".bash_history", ".zsh_history",
    ".python_history", ".psql_history", ".mysql_history", ".lesshst", ".viminfo", ".gitconfig", "id_rsa", "id_ed25519",
    "id_ecdsa",
    "id_dsa", "credentials", "credentials.json", "hosts.yml", ".boto", ".s3cfg", ".my.cnf", ".secrets",
})
# Host places a libc, a toolkit or a runtime looks at by itself (and copes when they are not there).
QUIET = ("/sys/", "/run/systemd/", "/var/run/systemd/", "/run/dbus/", "/var/run/dbus/", "/var/lib/dbus/",
         "/run/nscd/", "/var/run/nscd/", "/var/cache/", "/var/lib/dpkg/", "/var/lib/systemd/", "/run/udev/",
         "/run/resolvconf/", "/run/systemd-resolved", "/dev/log")
TRACING = ("/sys/kernel/debug/tracing/", "/sys/kernel/tracing/")  # what runtimes write trace markers to
NOTED = ("/var/tmp/",)  # another place for temporary files, which the cell does not have: its /tmp is its own
# Names in the host's /tmp that tools use for themselves: no secret, no attempt.
TMP_QUIET = frozenset({".X11-unix", ".ICE-unix", ".XIM-unix", ".font-unix", ".Test-unix"})
# Devices whose only use from a cell is to read or write the host beneath every wall.
HOST_DEVICES = ("mem", "kmem", "port", "kmsg", "sd", "hd", "vd", "xvd", "nvme", "mmcblk", "loop", "dm-", "md",
                "sr", "mapper", "disk", "input", "uinput", "tty0", "tty1", "tty2", "tty3", "tty4", "tty5", "tty6",
                "tty7", "tty8", "tty9", "console", "ttyS", "vhost", "vsock", "kvm", "cpu", "watchdog", "nvram",
                "rtc", "hidraw", "bus", "fb", "snd", "video", "sg", "bsg", "btrfs-control", "fuse")
DNS_PORTS = (53, 853)
# What a tool reads of a process to see whether it runs and what it is (ps, top, pgrep, psutil, a pidfile's
# check): a number the cell ever had, looked at this way, is the cell's own business, however long ago.
# Anything else (root, cwd, environ, mem, maps, fd, ...) reaches into the process.
LOOKS = frozenset({"", "stat", "status", "statm", "cmdline", "comm", "cgroup", "wchan", "sched", "schedstat",
                   "io", "limits", "oom_score", "oom_score_adj", "loginuid", "sessionid", "task"})
AF_INET, AF_INET6, AF_PACKET, SOCK_DGRAM, SOCK_RAW, IPPROTO_ICMP, IPPROTO_ICMPV6 = 2, 10, 17, 2, 3, 1, 58
SHARED_TMP = ("/tmp/", "/var/tmp/", "/dev/shm/")
LOCKS = (".lock", ".lck", "/lock")
# Protected entries that only instruct a harness (and the session's own configuration): writing them is
# refused and noted, not an attempt on the human's tools.
INSTRUCTIONS = frozenset({"AGENTS.md", "CLAUDE.md", "GEMINI.md", "copilot-instructions.md", ".cursorrules",
                          ".windsurfrules", ".clinerules", "agentcell.toml"})

WRITES = frozenset({"creat", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2",
                    "link", "linkat", "symlink", "symlinkat", "chmod", "fchmodat", "fchmodat2", "chown", "lchown",
                    "fchownat", "truncate", "mknod", "mknodat", "setxattr", "lsetxattr", "removexattr",
                    "lremovexattr", "utimensat"})
Verdict = tuple[str, str, str, bool, str]  # operation, target, reason, acts, what would allow it


class Classifier:
    """``classify(call)`` for one cell; :meth:`ended` for each of its tasks that ends (the calls' ring
    hands both over in the order they happened). ``lost()``: whether the kernel dropped any of the cell's
    events (an ended task among them, maybe)."""

    def __init__(self, view: View, network: str, host: Host, lost: Callable[[], bool] = lambda: False,
                 refused: Callable[[str, int], None] | None = None) -> None:
        self.view, self.network, self.host, self.lost = view, network, host, lost
        self.refused = refused  # on the host's network: a connect the firewall refused, and by whom
        self.numbers = Numbers()  # what the cell's pid namespace did with its numbers (the task ring)
        # reads what the task ring holds by now (set by the source that feeds both): a task the cell
        # started since the ring was last read is in it, never taken for one from before the events
        self.catch_up: Callable[[], None] = lambda: None

    def _whose(self, call: Call, pid: int) -> str:
        """What ``pid``, a number the cell named that its namespace did not have and a host process has,
        was to the cell (:meth:`Numbers.state`), never decided by how the host's pids compare with the
        cell's; ``unknown`` if that cannot be told (the kernel dropped some of the cell's task events, or
        does not say what number a task had)."""
        state = self.numbers.state(pid, call.ktime)
        if state == "never" and not self.numbers.known(pid) and self.host.exists_in_cell(f"/proc/{pid}"):
            self.catch_up()  # (the cell may have given the number to a task since the ring was read)
            state = self.numbers.state(pid, call.ktime)
            if state == "never" and not self.numbers.known(pid):
                return "alive"  # a task of the cell from before the events came (its PID 1)
        if state in ("had", "never") and (self.numbers.unknown or self.lost()):
            return "unknown"
        return state

    def classify(self, call: Call) -> Verdict | None:
        if call.name in ("kill", "pidfd_open"):
            return self._pid(call)
        if call.name == "socket":
            return self._socket(call)
        if call.addr is not None:
            return self._network(call)
        if not call.path and not call.path2:
            return None
        first = self._path(call, call.path, DIRFD.get(call.name)) if call.path else None
        verdicts = [] if first is None else [self._named(call.path, self._file(call, first,
                                                                              self._op(call, second=False)))]
        if call.path2:
            second = self._path(call, call.path2, DIRFD2.get(call.name))
            if second is not None:
                verdicts.append(self._named(call.path2, self._file(call, second, "write")))
        found = [v for v in verdicts if v is not None]
        return next((v for v in found if v[3]), found[0] if found else None)

    # ---- paths ------------------------------------------------------------------------------------

    def _path(self, call: Call, path: str, dirfd_arg: int | None) -> str | None:
        """The absolute path the call reached, as the kernel walks it in the cell (relative ones from its
        directory fd or working directory, read now: None if the process has gone and left no way to
        tell)."""
        if not path.startswith("/"):
            base: str | None
            fd = call.args[dirfd_arg] if dirfd_arg is not None else AT_FDCWD
            fd = fd - (1 << 64) if fd >= 1 << 63 else fd
            base = self.host.cwd(call.pid, call.tid) if fd == AT_FDCWD or fd & 0xFFFFFFFF == AT_FDCWD & 0xFFFFFFFF \
                else self.host.fd_path(call.pid, fd, call.tid)
            if base is None:
                return None
            path = os.path.join(base, path)
        # symlinks, and ".." after them, as the kernel took them; /proc/N/root of a task of the cell's that has
        # ended since (PID 1 ran as long as any of them did)
        walked = self.host.resolve(path, call.pid, call.tid, lambda n: n == 1 or self._whose(call, n) == "alive")
        return walked if walked is not None else self.view.resolve_links(os.path.normpath(path).replace("//", "/"))

    @staticmethod
    def _named(named: str, v: Verdict | None) -> Verdict | None:
        """Say how the process named it, when that is not where it led (links, "..")."""
        if v is None or not named.startswith("/") or os.path.normpath(named) == v[1]:
            return v
        return (v[0], v[1], f"{v[2]} (named as {named[:300]})", v[3], v[4])

    def _op(self, call: Call, *, second: bool) -> str:
        if call.name in ("execve", "execveat"):
            return "execute"
        if call.name in ("link", "linkat") and not second:
            return "read"  # its source: what it would give a second name to
        if call.name in WRITES or call.errno == EROFS:
            return "write"
        if call.name in ("open", "openat", "openat2") and (call.flags & O_ACCMODE or call.flags & (O_CREAT | O_TRUNC)):
            return "write"
        return "read"

    def _file(self, call: Call, path: str, op: str) -> Verdict | None:
        area, mount = self.view.area(path)
        e = call.errno
        if op == "write" and (path == "/sys" or path.startswith("/sys/")):
            if path.startswith(TRACING):
                return None  # a runtime's trace markers (Bun, JavaScriptCore: Claude Code, OpenCode at start)
            return ("write", path, "a kernel setting or a control group (/sys: the cell has none)", True,
                    "nothing: a cell never changes the kernel")
        if area == "mask":
            if mount in self.view.declared_masks:  # a .env in the project: agents read those without a thought
                return (op, path, "a path the policy masks in the declared paths (the cell sees an empty file or "
                        "directory there)", False, f"drop --mask {mount}")
            return (op, path, "a secret of the host the cell hides (masked: an empty file or directory of the "
                    "cell's own is there)", True, "nothing: a secret of the host")
        if area in ("system", "ro", "guarded", "pinned"):
            return self._read_only(call, path, op, area, mount)
        if area == "proc":
            return self._proc(call, path, op)
        if area == "dev":
            name = path[len("/dev/"):]
            if e == ENOENT and name.startswith(HOST_DEVICES):
                return (op, path, "a device of the host (the cell's /dev has only null, zero, full, random, urandom "
                        "and tty)", True, "nothing: devices stay outside")
            if e == ENOENT and self.host.is_device(path):
                return (op, path, "a device of the host that the cell's /dev does not have", False,
                        "nothing: devices stay outside")
            return None
        if area == "hidden":
            return self._hidden(call, path, op)
        if e != ENOENT:  # the cell's own writable places: a refusal there is the host's permissions, or a race
            return None
        if area == "private" and path.startswith("/tmp/"):
            return self._shared_tmp(path, op)
        return None

    def _read_only(self, call: Call, path: str, op: str, area: str, mount: str) -> Verdict | None:
        """The system, a --ro path, a protected entry of the project: all there, all read-only."""
        e = call.errno
        if e == EXDEV and call.name in ("link", "linkat"):
            return ("write", path, "a hard link across the cell's mounts (the kernel refuses it: EXDEV)", False, "")
        if area in ("guarded", "pinned"):
            if op != "write" or e not in (EROFS, EBUSY, EACCES, EPERM, EXDEV):
                return None
            # Inside the declared paths, and refused: noted as it happens. An agent asked to add a hook or to
            # update AGENTS.md tries exactly this; what it plants where nothing was bound is moved aside.
            what = ("the instructions a harness reads" if os.path.basename(mount) in INSTRUCTIONS else
                    "what the human's tools run or obey: git hooks and config, harness settings, shell rc files")
            return ("write", path, f"a write to a protected path in the project ({what}: read-only in the cell)",
                    False, f"--allow-write {mount}")
        if op != "write":
            if area == "system" and e in (EACCES, EPERM):
                return (op, path, "a file of the system that the cell's account may not read (its permissions)",
                        True, "nothing: the host's permissions decide")
            return None  # a missing file where the cell sees the host's tree as it is: an ordinary lookup
        if e not in (EROFS, EACCES, EPERM):
            return None
        if "/__pycache__/" in path and path.endswith(".pyc"):
            return None  # Python caching byte code next to a read-only module: it goes on without
        if path.endswith(LOCKS) and op == "write":
            return ("write", path, "a lock file in the read-only system (software claiming a shared cache it finds "
                    "read-only, as Copilot's package cache in /opt)", False, "")
        if area == "ro":  # declared for reading: a mistake to write there, not a way out
            return ("write", path, f"a write to a path declared read-only ({mount})", False, f"--rw {mount}")
        return ("write", path, "a write to the read-only system", True, "nothing: write inside the --rw paths")

    def _shared_tmp(self, path: str, op: str) -> Verdict | None:
        parts = path.split("/")
        if len(parts) < 3 or parts[2] in TMP_QUIET or not self.host.exists(path):
            return None
        if _credential(path):
            return (op, path, "a credential in the host's shared /tmp (the cell's /tmp is its own)", True,
                    "nothing: the host's /tmp stays outside")
        return (op, path, "a name of the host's shared /tmp, which the cell's own /tmp does not have", False, "")

    def _hidden(self, call: Call, path: str, op: str) -> Verdict | None:
        """A path the cell does not contain (or the empty directories that lead to what it does)."""
        if path.startswith(QUIET):
            return None
        if path.startswith(f"/run/user/{self.view.uid}/") or path == f"/run/user/{self.view.uid}":
            return None  # a runtime directory of the cell's own account (XDG_RUNTIME_DIR is not set in a cell)
        if path.startswith(NOTED) or path + "/" in NOTED:
            return (op, path, "a place for temporary files that the cell does not have (its /tmp is its own)", False,
                    "use /tmp")
        if path.count("/") == 1 and path not in self.host.homes() and op != "write":
            if not self.host.exists(path):
                return None  # (a top-level directory of the host, looked at: /var, /srv; not a home)
            return (op, path, "a top-level directory of the host, which the cell does not have", False, "")
        homes = self.host.homes()
        home = next((h for h in homes if path == h or path.startswith(h + "/")), None)
        credential = _credential(path)
        parent = os.path.dirname(path)
        if parent in self.view.ancestors and home != path and not credential and op != "write":
            # next to what the cell contains: a tool looking for its config in a parent directory
            if not self.host.exists(path):
                return None
            return (op, path, "a name next to the cell's paths, which the cell does not have (tools look for "
                    "their configuration in parent directories)", False, f"--ro {path}")
        # What is not there is nothing to reach, but a credential's name in a home, or a new name in a
        # host directory that is there (a write outside the declared paths).
        there = self.host.exists(path) or op == "write" and self.host.exists(parent)
        if not (credential and home is not None) and not there:
            return None
        what = ("a credential in the home of a host account" if credential and home else
                "the home of a host account" if home else "a host path outside the cell's declared paths")
        allow = "nothing: credentials stay outside" if credential else f"--{'rw' if op == 'write' else 'ro'} {path}"
        return (op, path, f"{what} (the cell does not contain it)", True, allow)

    def _proc(self, call: Call, path: str, op: str) -> Verdict | None:
        parts = path.split("/")
        if len(parts) >= 3 and parts[2].isascii() and parts[2].isdigit() and call.errno in (ENOENT, ESRCH):
            pid = int(parts[2])
            if not self.host.pid_exists(pid):
                return None  # no such process anywhere
            whose = self._whose(call, pid)
            entry = parts[3] if len(parts) > 3 else ""
            if whose == "alive":
                return None  # one of the cell's own when the call was made: a name below it was not there
            if whose == "never" or whose == "had" and entry not in LOOKS:
                return (op, path, f"a host process (pid {pid}) through /proc: the cell's /proc shows its own "
                        "processes only", True, "nothing: host processes stay outside")
            why = {"ended": "gave up a moment ago (one of its own processes, just ended)",
                   "had": "had before (one of its own processes, ended: a look at whether it runs)",
                   "unknown": "may have had (the kernel did not hand over all of its tasks)"}[whose]
            return (op, f"/proc/{pid}", f"a /proc entry of a number a host process has, which the cell {why}",
                    False, "")
        if path in ("/proc/kmsg", "/proc/kcore") and call.errno in (EACCES, EPERM):
            return (op, path, "the kernel's log or memory", True, "nothing: the kernel stays outside")
        if op == "write" and (path.startswith("/proc/sys/") or path == "/proc/sysrq-trigger"):
            return ("write", path, "a kernel setting", True, "nothing: a cell never changes the kernel")
        return None

    # ---- processes and the network ----------------------------------------------------------------

    def _pid(self, call: Call) -> Verdict | None:
        pid = call.args[0] & 0xFFFFFFFF
        pid = pid - (1 << 32) if pid >= 1 << 31 else pid
        if call.errno != ESRCH or pid <= 0 or not self.host.pid_exists(pid) or \
                self._whose(call, pid) not in ("never", "unknown"):
            return None  # (a number of its own: a stale pid, a child just ended)
        return ("execute", f"{call.name} pid {pid}", "a signal or handle for a host process (not in the cell's "
                "pid namespace: refused)", False, "")

    def _socket(self, call: Call) -> Verdict | None:
        """A socket the cell's account may not make: raw IP, packet, ICMP (ping's). It would reach past the
        proxy; ordinary tools try it (ping) and cope."""
        family, kind, proto = call.args[0] & 0xFFFFFFFF, call.args[1] & 0xF, call.args[2] & 0xFFFFFFFF
        if call.errno not in (EPERM, EACCES):
            return None
        if family == AF_PACKET:
            target, what = "socket packet", "a packet socket (every frame on a network interface)"
        elif family in (AF_INET, AF_INET6) and kind == SOCK_RAW:
            target, what = f"socket {'inet6' if family == AF_INET6 else 'inet'} raw", "a raw IP socket"
        elif family in (AF_INET, AF_INET6) and kind == SOCK_DGRAM and proto in (IPPROTO_ICMP, IPPROTO_ICMPV6):
            target, what = f"socket {'inet6' if family == AF_INET6 else 'inet'} icmp", "an ICMP socket (ping)"
        else:
            return None
        return ("network", target, f"{what}: the cell's account may not make one, and the cell has no network "
                "beyond the proxy's allow-list", False, "--net proxy with --allow-domain NAME (TCP to names only)")

    def _network(self, call: Call) -> Verdict | None:
        addr = call.addr
        assert addr is not None
        e = call.errno
        if addr[0] == "abstract":
            # Any account of the host can bind any abstract name: one a tool of the cell looks for (its own
            # single-instance socket) must not be a way for an outsider to end the cell. Noted.
            if e == ECONNREFUSED and addr[1] and self.host.abstract(addr[1]):
                return ("network", f"@{addr[1]}", "an abstract socket the host has (another network namespace's, "
                        "any account's)", False, "nothing: the host's sockets stay outside")
            return None
        if addr[0] == "unix":
            path = self._path(call, addr[1], None)
            if path is None:
                return None
            if call.name == "bind":  # a socket file made: a write of that path
                return self._named(addr[1], self._file(call, path, "write"))
            if e not in (ENOENT, ECONNREFUSED, EACCES, EPERM) or path.startswith(QUIET):
                return None  # (the system's own services, which libc and toolkits try by themselves)
            if self.view.area(path)[0] not in ("hidden", "private") or not self.host.is_socket(path):
                return None
            if path.startswith(SHARED_TMP):  # any account may make a socket there (a tmux-<uid>/default)
                return ("network", path, "a socket in a temporary directory the host's accounts share", False,
                        "nothing: the host's sockets stay outside")
            return ("network", path, "a socket of a service on the host (the cell does not contain it)", True,
                    "nothing: the host's sockets stay outside")
        family, ip, port = addr
        if self.network == "host-firewall":  # the firewall's log says what it refused; this says who tried
            if self.refused is not None and e in (ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EACCES, EPERM):
                self.refused(f"[{ip}]:{port}" if family == "inet6" else f"{ip}:{port}", call.pid)
            return None
        if e in (EACCES, EPERM):
            return None  # Landlock's own records say so
        target = f"{ip}:{port}"
        if ip.startswith("127.") or ip == "::1" or ip == "::ffff:127.0.0.1":
            # refused (or, connecting without blocking, to be refused): the cell's loopback is its own
            if e in (ECONNREFUSED, EINPROGRESS) and self.host.listens(port) and not self.host.listens(port, cell=True):
                return ("network", target, "a port the host listens on, tried on the cell's own loopback (it is "
                        "not the host's)", False, "")
            return None
        if e == EINPROGRESS or ip in ("0.0.0.0", "::"):
            return None  # a connection under way (where the cell has a route: through the proxy)
        if port in DNS_PORTS and ip in self.host.resolvers():  # libc asking the host's own resolver
            return ("network", target, "a DNS query to the host's resolver: the cell has none (the proxy resolves "
                    "names)", False, "--net proxy (names are resolved there)")
        return ("network", target, "a connection or datagram to an address outside the cell (its network "
                "namespace has no way there)", True, "--net proxy with --allow-domain NAME")


def _credential(path: str) -> bool:
    parts = path.split("/")
    return (any(p in CREDENTIALS or p.startswith("krb5cc") for p in parts)  # (Kerberos tickets in /tmp)
            or any(p.startswith("ssh-") for p in parts[:-1]) and parts[-1].startswith("agent."))
