#!/usr/bin/env bash
# Run a command (CI: ./test.sh) as a fresh machine would see this one, so that a test passing only because
# an earlier run left something behind fails here too. As root, in a private mount namespace of its own:
#   * /tmp and /var/tmp are new, empty directories on their own filesystems (a fresh Debian 12 keeps them on
#     its root filesystem: setuid bits, ACLs and the order of a directory's entries are those), made here
#     and removed at the end; /dev/shm is an empty tmpfs, as at boot;
#   * agentcell's own state from earlier runs is out of sight: /run/agentcell, /var/lib/agentcell and root's
#     XDG state (~/.local/state/agentcell) are empty tmpfs (each made as an empty directory first if missing);
#   * what survives is download caches only: /opt/agentcell-test (the harness CLIs the tests install, pinned:
#     tests/harnesses.py), and pip's, npm's and apt's own caches. A fresh machine downloads them once;
#     keeping them changes how long a run takes, not what it tests.
# The checkout itself is kept where it is, even below /tmp. Nothing mounted here is seen outside. Then it
# lists what the command left in those fresh places and on the host (accounts, cgroups, network namespaces,
# links, nftables tables named agentcell/ac-): a leftover fails the run.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "fresh-machine.sh: run me as root (I mount in a mount namespace of my own)" >&2
  exit 1
fi

if [ -z "${AGENTCELL_FRESH_TMP:-}" ]; then  # outside: the new /tmp and /var/tmp, removed once the namespace is gone
  tmp=$(mktemp -d /tmp/.agentcell-fresh-XXXXXX)
  vartmp=$(mktemp -d /var/tmp/.agentcell-fresh-XXXXXX)
  chmod 1777 "$tmp" "$vartmp"
  status=0
  AGENTCELL_FRESH_TMP="$tmp:$vartmp" unshare --mount --propagation private -- "$0" "$@" || status=$?
  rm -rf "$tmp" "$vartmp"  # (the binds were the namespace's alone: here these are plain directories)
  exit "$status"
fi
IFS=: read -r tmp vartmp <<<"$AGENTCELL_FRESH_TMP"
unset AGENTCELL_FRESH_TMP
if [ "$(readlink /proc/self/ns/mnt)" = "$(readlink "/proc/$PPID/ns/mnt")" ]; then
  echo "fresh-machine.sh: not in a mount namespace of my own; refusing to hide the host's /tmp" >&2
  exit 1
fi

here=$(pwd -P)
# Over DIR: SOURCE bound (a directory), or an empty tmpfs of mode MODE. The checkout, if it lies below DIR,
# is bound back at its own path.
fresh() {
  local dir=$1 source=$2 mode=$3 keep=""
  [ -d "$dir" ] || mkdir -p -m "$mode" "$dir"
  if [[ "$here/" == "$dir/"* ]]; then
    exec 8<"$here"
    keep=1
  fi
  if [ -n "$source" ]; then
    mount --bind "$source" "$dir"
  else
    mount -t tmpfs -o "mode=$mode,nosuid,nodev" agentcell-fresh "$dir"
  fi
  if [ -n "$keep" ]; then
    mkdir -p "$here"
    mount --no-canonicalize --bind /proc/self/fd/8 "$here"  # (the fd: the name now leads into the new dir)
    exec 8<&-
  fi
}
STATE=(/run/agentcell /var/lib/agentcell "$HOME/.local/state/agentcell")
fresh /tmp "$tmp" 1777
fresh /var/tmp "$vartmp" 1777
fresh /dev/shm "" 1777
for d in "${STATE[@]}"; do fresh "$d" "" 0700; done
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
left=$(comm -13 <(sort <<<"$before") <(sort <<<"$after") || true)
for d in /tmp /var/tmp /dev/shm; do  # (pytest keeps its last three temporary trees by design: pytest-of-USER)
  left+=$'\n'$(find "$d" -mindepth 1 -maxdepth 1 ! -name 'pytest-of-*' 2>/dev/null | while read -r p; do
                 [[ "$here/" == "$p/"* ]] || echo "$p"; done || true)
done
for d in "${STATE[@]}"; do  # records of what exists (directories and locks stay; caches: the BPF layout, filters)
  left+=$'\n'$(find "$d" -mindepth 1 ! -type d ! -name '*.lock' ! -name btf-layout.json ! -name calls.json \
                ! -path '*/seccomp/*.bpf' 2>/dev/null || true)
done
left=$(sed '/^$/d' <<<"$left")
if [ -n "$left" ]; then
  echo "fresh-machine.sh: the run left these behind (a test or a command does not clean up what it made):" >&2
  sed 's/^/  /' <<<"$left" >&2
  while read -r p; do  # who made it, when, and what is in it: enough to find the test that did
    [ -e "$p" ] || continue
    stat -c '    %n: %F, %U:%G, mode %a, made %w, changed %y' "$p" >&2 2>/dev/null || true
    if [ -d "$p" ]; then find "$p" -mindepth 1 -maxdepth 2 2>/dev/null | head -n 12 | sed 's/^/      /' >&2 || true; fi
  done <<<"$left"
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
