# Sourced by demo.sh and test.sh: install what agentcell needs on Debian 12 and build .venv.
# Idempotent and quiet when everything is already there.
set -euo pipefail

# One setup at a time (test.sh and demo.sh may run side by side); released at the end.
exec 9<scripts/setup.sh
flock 9

APT_PACKAGES=(python3 python3-venv python3-dev acl iproute2 nftables bubblewrap procps util-linux libseccomp2 git gcc libc6-dev spin)

need=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing packages ${need[*]}; run as root (or: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "+ apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Debian's interpreter, not a per-user one (pyenv under /root): the tests run agentcell as
# throwaway non-root users too, and they must be able to execute the venv's python.
PY=/usr/bin/python3
stamp=.venv/.agentcell-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || [ "$(readlink -f .venv/bin/python)" != "$(readlink -f $PY)" ]; then
  rm -rf .venv
  echo "+ $PY -m venv .venv"
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "+ .venv/bin/pip install -e '.[dev,mcp,langchain,ray,docs]'"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev,mcp,langchain,ray,docs]'
  echo "$want" > "$stamp"
fi

# The compiled front (front/agentcell.c) is the `agentcell` command: it hands `agentcell run` to a running
# warm launcher without a Python start, and runs this checkout's Python CLI for everything else.
if [ "$(head -c2 .venv/bin/agentcell 2>/dev/null)" = "#!" ] || [ front/agentcell.c -nt .venv/bin/agentcell ]; then
  echo "+ cc -O2 -o .venv/bin/agentcell front/agentcell.c"
  cc -O2 -Wall -Wextra -Werror -DAGENTCELL_PYTHON="\"$PWD/.venv/bin/python3\"" \
     -DAGENTCELL_SCRIPT="\"$PWD/bin/agentcell\"" -o .venv/bin/agentcell.new front/agentcell.c
  mv -f .venv/bin/agentcell.new .venv/bin/agentcell
fi

flock -u 9
exec 9<&-
