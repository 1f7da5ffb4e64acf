"""Every escape probe of :mod:`test_escape`, again under the escape monitor (issues 7 and 15).

Each probe must still be contained, and the monitor must report exactly what the table below says
for it: the events (operation, source, target, whether it acts), each with the offending process
named (pid and executable) unless it is a resource event (the cgroup's counters name no process).
``NOT_ATTEMPTS`` are the probes that try nothing the kernel could refuse or report: they look for what
the launcher would have leaked (an environment variable, an fd, another process in the cell's own
/proc) or write where the cell's own private places are; there is nothing to see. A change in what
the monitor sees, more or less, fails here.
"""
from __future__ import annotations

import fnmatch
import json
import os

import pytest
from test_escape import PROBES, World, nethost, run_contained  # noqa: F401 - nethost: a fixture
from test_escape import world as world  # the fixture, under its own name

from conftest import needs_root

pytestmark = needs_root

COLLECT = os.environ.get("AGENTCELL_COLLECT_MONITOR")  # a file: write what was seen, assert nothing

NOTE, ACTS = False, True
CANARIES_FOUND_BY_A_SEARCH = [("read", "canary", "~/.aws/credentials", ACTS),
                              ("read", "canary", "~/.ssh/id_ed25519", ACTS), ("read", "canary", "~/.ssh/id_rsa", ACTS)]
ESCAPE_TMP = "/tmp/agentcell-escape-*"
NET_HOST = "198.1[89].*"
# probe -> [(operation, source, target pattern, acts)]; ~ is the cell's home, {project} the project
SEEN: dict[str, list[tuple[str, str, str, bool]]] = {
    # credentials and secrets of the host
    "ssh_key_by_path": [("read", "calls", f"{ESCAPE_TMP}/home/.ssh/id_ed25519", ACTS)],
    "ssh_key_by_search": [("read", "calls", "/root", ACTS), ("read", "calls", "/var/tmp", NOTE),
                          *CANARIES_FOUND_BY_A_SEARCH],
    "cloud_credentials_via_home": [("read", "canary", "~/.aws/credentials", ACTS),
                                   ("read", "canary", "~/.config/gh/hosts.yml", ACTS),
                                   ("read", "canary", "~/.ssh/id_ed25519", ACTS)],
    "human_ssh_key_by_absolute_path": [("read", "calls", "/home/ac-t*/.ssh/id_ed25519", ACTS)],
    "sibling_repository_of_the_human": [("read", "calls", "/home/ac-t*/other-repo/deploy/secrets.env", ACTS)],
    "etc_shadow_as_group_shadow": [("read", "calls", "/etc/shadow", ACTS)],
    "etc_shadow_under_declared_ro_etc": [("read", "calls", "/etc/shadow", ACTS)],
    # host processes
    # (and through its own /proc/PID/root, a name of the host's /tmp: a note)
    "proc_root_and_cwd_of_host_process": [("read", "calls", "/proc/*/cwd/notes.txt", ACTS),
                                          ("read", "calls", f"/proc/*/root{ESCAPE_TMP}/cwd/notes.txt", ACTS),
                                          ("read", "calls", f"{ESCAPE_TMP}/cwd/notes.txt", NOTE)],
    # the probe re-opens its own fds through /proc/PID/fd; its stdin is the *host's* /dev/null (the
    # caller's), outside every Landlock rule: refused, and reported
    "proc_fd_of_host_process": [("read", "calls", "/proc/*/fd", ACTS), ("read", "landlock", "/dev/null", ACTS)],
    "proc_mem_of_host_process": [("read", "calls", "/proc/*/maps", ACTS)],
    "process_vm_readv_of_host_process": [("read", "calls", "/proc/*/maps", ACTS)],
    "pidfd_getfd_from_host_process": [("execute", "calls", "pidfd_open pid *", NOTE)],
    "ptrace_host_process": [("execute", "seccomp", "ptrace pid *", ACTS)],
    # out of the project, into the host
    "symlink_read_out_of_project": [("read", "calls", f"{ESCAPE_TMP}/home/.ssh/id_ed25519", ACTS)],
    "symlink_write_out_of_project": [("write", "calls", f"{ESCAPE_TMP}/home/.bashrc", NOTE)],
    "hardlink_hidden_file_into_project": [("read", "calls", f"{ESCAPE_TMP}/home/notes", NOTE)],
    "hardlink_ro_file_into_project": [("write", "calls", f"{ESCAPE_TMP}/ro/notes", NOTE)],
    "write_into_usr": [("write", "calls", "/usr/local/agentcell-escape-*-planted", ACTS)],
    "write_into_etc": [("write", "calls", "/etc/agentcell-escape-*-planted", ACTS)],
    "write_into_the_humans_home": [("write", "calls", "/home/ac-t*", ACTS)],  # (its makedirs, first)
    "plant_in_var_tmp": [("write", "calls", "/var", ACTS)],  # (likewise)
    # persistence in the project: refused (read-only binds, EROFS) or moved aside at the end; noted live
    "git_hook_in_project": [("write", "calls", "{project}/.git/hooks/pre-commit", NOTE)],
    "git_config_fsmonitor_in_project": [("write", "calls", "{project}/.git/config", NOTE)],
    "git_hook_of_nested_repo": [("write", "calls", "{project}/vendor/lib/.git/hooks/post-checkout", NOTE)],
    "git_hook_after_swapping_the_git_dir": [("write", "calls", "{project}/.git", NOTE)],
    "harness_config_in_repo": [("write", "calls", "{project}/.claude/settings.json", NOTE)],
    "harness_config_in_project_without_git": [("write", "calls", "{project}/.claude/settings.json", NOTE)],
    "harness_config_created_in_project": [("write", "created", "{project}/.claude", NOTE)],
    "mcp_config_in_repo": [("write", "calls", "{project}/.mcp.json", NOTE)],
    "shell_rc_in_repo": [("write", "calls", "{project}/.envrc", NOTE)],
    # outliving the cell: noted when the command ends, killed with the cell
    "setsid_sleep_outlives_the_run": [("execute", "exec", "/usr/bin/*", NOTE)],
    "double_fork_daemon_outlives_the_run": [("execute", "exec", "/usr/bin/python3*", NOTE)],
    # the network
    "tcp4_to_test_host": [("network", "landlock", f"{NET_HOST}:8080", ACTS)],
    "udp4_to_test_host": [("network", "calls", f"{NET_HOST}:8081", ACTS)],
    "dns_query_to_test_host": [("network", "calls", f"{NET_HOST}:53", ACTS)],  # (not the host's resolver)
    "tcp6_to_test_host": [("network", "landlock", "fd00:ac:*:8080", ACTS)],
    "udp6_to_test_host": [("network", "calls", "fd00:ac:*:8081", ACTS)],
    # ping's socket and a raw one, refused to the cell's account (it could not reach anything either): noted
    "icmp_echo_to_test_host": [("network", "calls", "socket inet icmp", NOTE), ("network", "calls", "socket inet raw",
                                                                                 NOTE)],
    "bash_dev_tcp_to_test_host": [("network", "landlock", f"{NET_HOST}:8080", ACTS)],
    "host_loopback_tcp4": [("network", "landlock", "127.0.0.1:*", ACTS)],
    "host_loopback_tcp4_under_net_loopback": [("network", "calls", "127.0.0.1:*", NOTE)],
    "host_loopback_tcp6": [("network", "calls", "::1:*", NOTE)],
    # any account of the host can bind an abstract name or a socket in /tmp: noted, so that no outsider can
    # end a cell by making the name one of its tools looks for
    "abstract_unix_socket_of_host": [("network", "calls", "@agentcell-escape-*", NOTE)],
    "pathname_unix_socket_of_host": [("network", "calls", "/tmp/agentcell-escape-net-*/sock/s", NOTE)],
    # privilege and the kernel
    "setuid_root_binary_on_shared_ro_path": [("execute", "exec", f"{ESCAPE_TMP}/bin/id", NOTE)],
    "file_capability_binary_on_shared_ro_path": [("execute", "exec", f"{ESCAPE_TMP}/bin/cat", NOTE)],
    "mount_tmpfs": [("write", "seccomp", "mount", ACTS)],
    "unshare_user_ns_then_mount": [("execute", "seccomp", "unshare", ACTS)],
    "tiocsti_into_the_terminal": [("write", "seccomp", "ioctl TIOCSTI", ACTS)],
    "bpf_map_create": [("execute", "seccomp", "bpf", ACTS)],
    "mknod_char_device_in_project": [("write", "landlock", "{project}", ACTS)],
    "device_node_of_the_host": [("read", "calls", "/dev/agentcell-escape-*", NOTE)],
    "control_group_made_in_sys_fs_cgroup": [("write", "calls", "/sys/fs/cgroup/*agentcell-escape-*/planted", ACTS)],
    # kernel surfaces ordinary software tries and copes without: noted
    "keyring_add_key": [("execute", "seccomp", "add_key", NOTE)],
    "io_uring_setup": [("execute", "seccomp", "io_uring_setup", NOTE)],
    "userfaultfd": [("execute", "seccomp", "userfaultfd", NOTE)],
    "perf_event_open": [("execute", "seccomp", "perf_event_open", NOTE)],
    # resources: recorded (the python that forked the bomb leaves its children behind: noted)
    "fork_bomb": [("execute", "exec", "/usr/bin/python3*", NOTE), ("resource", "cgroup", "pids_limit_hits", ACTS)],
    "memory_bomb": [("resource", "cgroup", "oom_kills", ACTS)],
    "cpu_spin": [("resource", "cgroup", "cpu_throttled", NOTE)],
}
NOT_ATTEMPTS: dict[str, str] = {
    **dict.fromkeys(("env_api_keys", "env_secret_under_an_innocent_name"),
                    "reads its own environment, which the launcher scrubbed: nothing is refused"),
    **dict.fromkeys(("inherited_fd_to_root_only_file", "inherited_directory_fd"),
                    "tries fds the launcher closed before the command existed: EBADF, nothing reached for"),
    **dict.fromkeys(("proc_environ_of_host_processes", "proc_cmdline_of_host_processes"),
                    "lists /proc and reads what is there: the cell's own processes only (its PID namespace)"),
    **dict.fromkeys(("plant_in_tmp", "plant_in_dev_shm"), "writes the cell's own private /tmp and /dev/shm"),
    "listening_port_reached_from_host": "listens in its own network namespace (allowed under --net loopback); "
                                        "the host's connection goes to the host's loopback, not the cell's",
}


def test_every_probe_is_classified() -> None:
    assert set(SEEN) | set(NOT_ATTEMPTS) == set(PROBES) and not set(SEEN) & set(NOT_ATTEMPTS)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_under_the_monitor(name: str, world: World) -> None:
    attempt = PROBES[name](world)
    attempt.flags = [*attempt.flags, "--monitor", "--on-escape", "record"]
    # A terminal probe's own pty would take agentcell's result line too: here it runs on pipes. Its
    # ioctl still reaches the filter (seccomp looks at the call, not at what the fd is).
    attempt.tty = None
    o = run_contained(attempt, world.user, world.project)
    events = o.result.get("events")
    assert isinstance(events, list), (o.err[-2000:], o.result)
    got = sorted({(e["operation"], e["source"], e["target"], bool(e["pid"]), os.path.basename(e["exe"] or ""),
                   e["acts"]) for e in events})
    if COLLECT:
        with open(COLLECT, "a") as f:
            f.write(json.dumps({"name": name, "got": got, "contained": attempt.judge(o) is None}) + "\n")
        return
    assert attempt.judge(o) is None, f"{name} escaped under the monitor\nerr: {o.err[-2000:]}"
    home = f"/home/{world.user.name}"
    want = sorted((op, src, pat.replace("~", home).replace("{project}", str(world.project)), acts)
                  for op, src, pat, acts in SEEN.get(name, []))
    assert len(got) == len(want), f"{name}: expected {want}, the monitor saw {got} ({NOT_ATTEMPTS.get(name, '')})"
    for (op, src, target, has_pid, exe, acts), (wop, wsrc, pattern, wacts) in zip(got, want, strict=True):
        assert (op, src, acts) == (wop, wsrc, wacts) and fnmatch.fnmatchcase(target, pattern), (name, got, want)
        if op != "resource":
            assert has_pid and exe, f"{name}: the event names no process: {got}"
    # The verdict under record: the command ran to its end; terminate is tested per source in test_monitor.
    assert o.result["terminated_by_monitor"] is False
