"""Every escape probe of :mod:`test_escape`, again under the escape monitor (issue 7).

Each probe must still be contained, and the monitor must report exactly what the table below says
for it — the event (operation, source, target) with the offending process named, or nothing where
the cell refuses by absence: the file, process, address or device the probe reaches for does not
exist in the cell, so the kernel has nothing to deny and nothing to report (ENOENT, ESRCH, ENETUNREACH,
EROFS from a read-only mount, a private /tmp). Those are listed with the reason, so a change in
what the monitor sees — more or less — fails here.
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

# probe -> the events (operation, source, target pattern), each with the offending pid and exe unless
# it is a resource event (the cgroup's counters name no process).
CANARIES_FOUND_BY_A_SEARCH = [("read", "canary", "~/.aws/credentials"), ("read", "canary", "~/.ssh/id_ed25519"),
                              ("read", "canary", "~/.ssh/id_rsa")]
SEEN: dict[str, list[tuple[str, str, str]]] = {
    "bpf_map_create": [("execute", "seccomp", "bpf")],
    "cloud_credentials_via_home": [("read", "canary", "~/.aws/credentials"), ("read", "canary",
                                   "~/.config/gh/hosts.yml"), ("read", "canary", "~/.ssh/id_ed25519")],
    "ssh_key_by_search": CANARIES_FOUND_BY_A_SEARCH,
    "fork_bomb": [("resource", "cgroup", "pids_limit_hits")],
    "memory_bomb": [("resource", "cgroup", "oom_kills")],
    "host_loopback_tcp4": [("network", "landlock", "127.0.0.1:*")],
    "tcp4_to_test_host": [("network", "landlock", "198.1[89].*:8080")],
    "bash_dev_tcp_to_test_host": [("network", "landlock", "198.1[89].*:8080")],
    "tcp6_to_test_host": [("network", "landlock", "fd00:ac:*:8080")],
    "mknod_char_device_in_project": [("write", "landlock", "{project}")],
    "mount_tmpfs": [("write", "seccomp", "mount")],
    "unshare_user_ns_then_mount": [("execute", "seccomp", "unshare")],
    "ptrace_host_process": [("execute", "seccomp", "ptrace pid *")],
    "tiocsti_into_the_terminal": [("write", "seccomp", "ioctl TIOCSTI")],
    # The probe re-opens its own fds through /proc/PID/fd; its stdin is the *host's* /dev/null (the
    # caller's), outside every Landlock rule. Harmless, and reported: a program reading /dev/stdin
    # with the caller's /dev/null as stdin is refused and, under terminate, ends the cell.
    "proc_fd_of_host_process": [("read", "landlock", "/dev/null")],
}
ABSENT = "refused by absence: what it reaches for does not exist in the cell, so no kernel check fails"
UNSEEN: dict[str, str] = {
    **dict.fromkeys(("ssh_key_by_path", "etc_shadow_as_group_shadow", "etc_shadow_under_declared_ro_etc",
                     "symlink_read_out_of_project", "symlink_write_out_of_project",
                     "hardlink_hidden_file_into_project", "hardlink_ro_file_into_project"),
                    ABSENT + " (host files: ENOENT; /etc/shadow: an empty mode-000 file, EACCES by permission)"),
    **dict.fromkeys(("proc_cmdline_of_host_processes", "proc_environ_of_host_processes", "proc_mem_of_host_process",
                     "proc_root_and_cwd_of_host_process", "process_vm_readv_of_host_process",
                     "pidfd_getfd_from_host_process"), ABSENT + " (host processes: not in the cell's PID namespace)"),
    **dict.fromkeys(("udp4_to_test_host", "udp6_to_test_host", "dns_query_to_test_host",
                     "host_loopback_tcp6", "host_loopback_tcp4_under_net_loopback", "listening_port_reached_from_host",
                     "abstract_unix_socket_of_host", "pathname_unix_socket_of_host"),
                    ABSENT + " (no route, no interface, another network namespace's sockets; Landlock does not "
                    "cover UDP)"),
    **dict.fromkeys(("git_config_fsmonitor_in_project", "git_hook_after_swapping_the_git_dir", "git_hook_in_project",
                     "git_hook_of_nested_repo", "harness_config_created_in_project",
                     "harness_config_in_project_without_git", "harness_config_in_repo", "mcp_config_in_repo",
                     "shell_rc_in_repo"),
                    "protected paths: EROFS from the read-only bind (decided before Landlock is asked); what is "
                    "created is quarantined and reported when the cell ends, not live"),
    **dict.fromkeys(("io_uring_setup", "keyring_add_key", "userfaultfd"),
                    "plain EPERM by design: ordinary software (node's libuv, krb5) tries these and copes"),
    **dict.fromkeys(("plant_in_tmp", "plant_in_dev_shm", "plant_in_var_tmp"),
                    "allowed: the cell's own private /tmp and /dev/shm, gone with it"),
    **dict.fromkeys(("setsid_sleep_outlives_the_run", "double_fork_daemon_outlives_the_run"),
                    "not an attempt the kernel refuses: the cell's PID namespace ends them with it"),
    **dict.fromkeys(("env_api_keys", "env_secret_under_an_innocent_name", "inherited_directory_fd",
                     "inherited_fd_to_root_only_file"), "nothing to refuse: the environment is scrubbed and fds "
                    "are closed before the command exists"),
    **dict.fromkeys(("setuid_root_binary_on_shared_ro_path", "file_capability_binary_on_shared_ro_path"),
                    "nosuid mounts: the exec succeeds without the privilege (the proc connector reports only "
                    "named privilege tools)"),
    "cpu_spin": "held by the CPU ceiling: throttling is not an event",
}


def test_every_probe_is_classified() -> None:
    assert set(SEEN) | set(UNSEEN) == set(PROBES) and not set(SEEN) & set(UNSEEN)


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
    got = sorted({(e["operation"], e["source"], e["target"], bool(e["pid"]), os.path.basename(e["exe"] or ""))
                  for e in events})
    if COLLECT:
        with open(COLLECT, "a") as f:
            f.write(json.dumps({"name": name, "got": got, "contained": attempt.judge(o) is None}) + "\n")
        return
    assert attempt.judge(o) is None, f"{name} escaped under the monitor\nerr: {o.err[-2000:]}"
    home = f"/home/{world.user.name}"
    want = [(op, src, pat.replace("~", home).replace("{project}", str(world.project))) for op, src, pat in
            SEEN.get(name, [])]
    assert len(got) == len(want), f"{name}: expected {want}, the monitor saw {got} ({UNSEEN.get(name, '')})"
    for (op, src, target, has_pid, exe), (wop, wsrc, pattern) in zip(got, sorted(want), strict=True):
        assert (op, src) == (wop, wsrc) and fnmatch.fnmatchcase(target, pattern), (name, got, want)
        if op != "resource":
            assert has_pid and exe, f"{name}: the event names no process: {got}"
    # The verdict under record: the command ran to its end; terminate is tested per source in test_monitor.
    assert o.result["terminated_by_monitor"] is False
