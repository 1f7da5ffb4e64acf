#!/usr/bin/env bash
# Run a command (CI: ./test.sh) as a fresh machine would see this one, so that a test passing only because
# an earlier run left something behind fails here too. As root, in a private mount namespace of its own:
#   * /tmp, /var/tmp and /dev/shm are empty tmpfs (a fresh boot's);
#   * agentcell's own state from earlier runs is out of sight: /run/agentcell, /var/lib/agentcell and root's
#     XDG state (~/.local/state/agentcell) are empty tmpfs (each made as an empty directory first if missing);
#   * what survives is download caches only: /opt/agentcell-test (the harness CLIs the tests install, pinned:
#     tests/harnesses.py), pip's and npm's caches under ~/.cache and ~/.npm, and apt's. A fresh machine
#     downloads them once; keeping them changes how long a run takes, not what it tests.
# The checkout itself is kept where it is, even below /tmp. Nothing mounted here is seen outside, and it all
# goes when the command ends. Then it lists what the command left in those fresh places and on the host
# (accounts, cgroups, network namespaces, nftables tables named agentcell/ac-): a leftover fails the run.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "fresh-machine.sh: run me as root (I mount tmpfs in a mount namespace of my own)" >&2
  exit 1
fi
if [ "${AGENTCELL_FRESH_NS:-}" != "$$" ]; then  # (exec keeps the pid: the mark says this process is inside)
  exec env AGENTCELL_FRESH_NS=$$ unshare --mount --propagation private -- "$0" "$@"
fi
unset AGENTCELL_FRESH_NS
if [ "$(readlink /proc/self/ns/mnt)" = "$(readlink "/proc/$PPID/ns/mnt")" ]; then
  echo "fresh-machine.sh: not in a mount namespace of my own; refusing to hide the host's /tmp" >&2
  exit 1
fi

here=$(pwd -P)
# An empty tmpfs over DIR (mode MODE); the checkout, if it lies below DIR, bound back at its own path.
fresh() {
  local dir=$1 mode=$2
  [ -d "$dir" ] || mkdir -p -m "$mode" "$dir"
  if [[ "$here/" == "$dir/"* ]]; then
    exec 8<"$here"
    mount -t tmpfs -o "mode=$mode,nosuid,nodev" agentcell-fresh "$dir"
    mkdir -p "$here"
    mount --no-canonicalize --bind /proc/self/fd/8 "$here"  # (the fd: the name now leads into the tmpfs)
    exec 8<&-
  else
    mount -t tmpfs -o "mode=$mode,nosuid,nodev" agentcell-fresh "$dir"
  fi
}
STATE=(/run/agentcell /var/lib/agentcell "$HOME/.local/state/agentcell")
for d in /tmp /var/tmp /dev/shm; do fresh "$d" 1777; done
for d in "${STATE[@]}"; do fresh "$d" 0700; done
cd "$here"

hostwide() {  # kernel objects and accounts of ours, by name
  getent passwd | cut -d: -f1 | grep -E '^(ac-|agentcell)' | sed 's/^/account /' || true
  find /sys/fs/cgroup -maxdepth 3 -name 'agentcell*' 2>/dev/null | sed 's/^/cgroup /' || true
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^(ac-|agentcell)' | sed 's/^/netns /' || true
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^(ac-|agentcell)' | sed 's/^/link /' || true
  nft list tables 2>/dev/null | awk '{print $3}' | grep -E '^(ac_|agentcell)' | sed 's/^/nft table /' || true
}
before=$(hostwide)
status=0
"$@" || status=$?

after=$(hostwide)
left=$(comm -13 <(sort <<<"$before") <(sort <<<"$after") | sed '/^$/d' || true)
for d in /tmp /var/tmp /dev/shm; do  # (pytest keeps its last three temporary trees by design: pytest-of-USER)
  left+=$'\n'$(find "$d" -mindepth 1 -maxdepth 1 ! -name 'pytest-of-*' 2>/dev/null || true)
done
for d in "${STATE[@]}"; do  # records of what exists (directories and locks stay; caches: the BPF layout, filters)
  left+=$'\n'$(find "$d" -mindepth 1 ! -type d ! -name '*.lock' ! -name btf-layout.json ! -name calls.json \
                ! -path '*/seccomp/*.bpf' 2>/dev/null || true)
done
left=$(sed '/^$/d' <<<"$left")
if [ -n "$left" ]; then
  echo "fresh-machine.sh: the run left these behind (a test or a command does not clean up what it made):" >&2
  sed 's/^/  /' <<<"$left" >&2
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
