#!/usr/bin/env bash
# Set everything up (apt packages, .venv with agentcell editable), then show `agentcell run` confining a
# scripted "agent" to a copy of examples/demo-project: it may edit the project and nothing else.
# Then the same project through a whole `agentcell session` (backup, per-session account, monitor,
# terminate at the first escape attempt, audit, diff, restore). Run as root (it creates, and always
# deletes, throwaway accounts). Exit 0 only if every attempt the cell should stop was stopped, the
# allowed edits landed, and the session ended at its escape attempt with everything recorded.
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
source scripts/setup.sh

REPO=$PWD
AGENTCELL=$REPO/.venv/bin/agentcell
if [ "$(id -u)" -ne 0 ]; then
  echo "demo.sh: run me as root (I create and delete a throwaway account): sudo $0" >&2
  exit 1
fi

section() { printf '\n== %s ==\n' "$*"; }
info() { printf '   %s\n' "$*"; }

# ---- everything the demo creates, recorded before it is created, removed on any exit -------------------------
WS="" DEMO_USER="" LISTENER_PID="" FINISHED=""
TAG=$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')
# Where the agent will try to write outside its project; each must still be absent afterwards.
OUT_USR=/usr/local/bin/agentcell-demo-$TAG
OUT_ETC=/etc/agentcell-demo-$TAG
CELL_TMP_NOTE=/tmp/ac-demo-note-$TAG

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM HUP
  echo
  [ -n "$FINISHED" ] || echo "demo.sh: stopped early (exit status $rc); the last step above is where" >&2
  if [ -n "$LISTENER_PID" ]; then
    kill "$LISTENER_PID" 2>/dev/null
    wait "$LISTENER_PID" 2>/dev/null
  fi
  if [ -n "$DEMO_USER" ] && getent passwd "$DEMO_USER" >/dev/null; then
    userdel "$DEMO_USER" || { sleep 1; userdel "$DEMO_USER"; } || echo "cleanup: could not delete account $DEMO_USER" >&2
    getent passwd "$DEMO_USER" >/dev/null || echo "cleanup: deleted account $DEMO_USER"
  fi
  rm -f -- "$OUT_USR" "$OUT_ETC" "$CELL_TMP_NOTE"  # only there if the cell failed; their names are unique
  if [ -n "$WS" ] && [ -d "$WS/session-state" ]; then  # a session cut short: its account, grants, cell
    AGENTCELL_STATE_DIR=$WS/session-state "$AGENTCELL" session recover >/dev/null 2>&1
  fi
  if [ -n "$WS" ]; then
    rm -rf -- "$WS" && echo "cleanup: removed $WS"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

echo "agentcell demo: a scripted \"agent\" works on a copy of examples/demo-project inside a cell."
echo "It is allowed to edit its project. Everything else it tries should be DENIED."

# ---- 1. the workspace, the bait outside the project, the account ---------------------------------------------
section "1. Setting the stage (on the host, as root)"
WS=$(mktemp -d /tmp/agentcell-demo-XXXX)
chmod 755 "$WS"  # so that only the cell, not file permissions, stands between the agent and the bait
PROJECT=$WS/project
cp -r examples/demo-project "$PROJECT"
info "project copy:        $PROJECT"

HOSTHOME=$WS/host-home  # stands in for a real user's home directory on this machine
SECRET=$HOSTHOME/.ssh/id_ed25519
mkdir -p "$HOSTHOME/.ssh"
echo "FAKE-DEMO-KEY-NOT-REAL" > "$SECRET"
chmod 777 "$HOSTHOME"
chmod 755 "$HOSTHOME/.ssh"
chmod 644 "$SECRET"
info "planted fake secret: $SECRET (mode 644: any account here may read it)"
info "a \"host home\":       $HOSTHOME (mode 777: any account here may write in it)"

export DEMO_API_KEY="sk-demo-FAKE-NOT-REAL"
info "exported in demo.sh: DEMO_API_KEY=$DEMO_API_KEY"

# A service on the host's loopback: only ever 127.0.0.1, on a port the kernel picks.
/usr/bin/python3 - "$WS/port" <<'PY' &
import os, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(8)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(s.getsockname()[1]))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    c, _ = s.accept()
    c.sendall(b"hello from the host\n")
    c.close()
PY
LISTENER_PID=$!
until [ -s "$WS/port" ]; do
  kill -0 "$LISTENER_PID" 2>/dev/null || { echo "demo.sh: the loopback listener did not start" >&2; exit 1; }
  sleep 0.05
done
PORT=$(cat "$WS/port")
info "host service:        127.0.0.1:$PORT (a listener demo.sh started)"

for _ in 1 2 3 4 5; do
  name="ac-demo$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')"
  getent passwd "$name" >/dev/null || break
done
DEMO_USER=$name  # recorded before it exists, so cleanup deletes it whatever happens next
useradd -M -s /usr/sbin/nologin "$DEMO_USER"
DEMO_UID=$(id -u "$DEMO_USER")
DEMO_GID=$(id -g "$DEMO_USER")
chown -R "$DEMO_USER:$DEMO_USER" "$PROJECT"
info "throwaway account:   $DEMO_USER (uid $DEMO_UID, no home on disk, no login shell); it owns the project copy"

SECRET_SUM=$(sha256sum < "$SECRET")
HOST_PROCS=$(find /proc -maxdepth 1 -name '[0-9]*' | wc -l)

# ---- 2. the same account without a cell ---------------------------------------------------------------------
section "2. The same account WITHOUT a cell (probed with setpriv; nothing is changed)"
as_user() { setpriv --reuid="$DEMO_UID" --regid="$DEMO_GID" --clear-groups -- "$@" >/dev/null 2>&1; }
can() {  # $1: what, then the probe
  local what=$1
  shift
  if as_user "$@"; then printf '   %-8s %s\n' CAN "$what"; else printf '   %-8s %s\n' CANNOT "$what"; fi
}
can "read $SECRET" cat "$SECRET"
can "write in $HOSTHOME" test -w "$HOSTHOME"
can "connect to 127.0.0.1:$PORT" /usr/bin/python3 -c \
  'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()' "$PORT"
can "see \$DEMO_API_KEY" sh -c '[ -n "${DEMO_API_KEY:-}" ]'
can "read /etc/shadow" cat /etc/shadow
can "list /root" ls -A /root
can "write in /usr/local/bin or /etc" sh -c 'test -w /usr/local/bin || test -w /etc'
info "(the CANNOTs are ordinary file permissions; inside the cell all of these must be DENIED)"

# ---- 3. the agent -------------------------------------------------------------------------------------------
# Runs inside the cell as $DEMO_USER. Each attempt prints one line: ALLOWED or DENIED, what, and why.
# Arguments: project, secret, host home, port, tag, host's process count, files it tries to plant outside.
AGENT_SCRIPT=$(cat <<'AGENT'
P=$1 SECRET=$2 HOSTHOME=$3 PORT=$4 TAG=$5 HOST_PROCS=$6 OUT_USR=$7 OUT_ETC=$8 NOTE=$9
say() { printf '%-8s %s\n' "$1" "$2"; }
why() { printf '%s\n' "$1" | tail -n 1 | sed 's/.*: //'; }  # the error text after the last ": "

try_read() {  # $1: file, $2: how the cell hides it
  if err=$(cat -- "$1" 2>&1 >/dev/null); then say ALLOWED "read $1 (the cell should have hidden it!)"
  else say DENIED "read $1 ($(why "$err"): $2)"; fi
}
try_list() {
  if err=$(ls -A -- "$1" 2>&1 >/dev/null); then say ALLOWED "list $1 (the cell should have hidden it!)"
  else say DENIED "list $1 ($(why "$err"): $2)"; fi
}
try_write() {
  if err=$( (printf 'planted by the demo agent\n' > "$1") 2>&1 ); then say ALLOWED "write $1 (outside the project!)"
  else say DENIED "write $1 ($(why "$err"): $2)"; fi
}

say INFO "the agent runs as: $(id)"
say INFO "working directory: $(pwd)"
echo

echo "-- (a) work on the project --"
if printf '\nEdited by the agent inside an agentcell cell (run %s).\n' "$TAG" >> "$P/README.md"; then
  say ALLOWED "edit project/README.md (appended one line)"
else
  say DENIED "edit project/README.md"
fi
if out=$(cd "$P" && python3 -m unittest 2>&1); then say ALLOWED "run the project's tests ($(printf '%s\n' "$out" | tail -n 1))"
else say INFO "the project's tests failed: $(printf '%s\n' "$out" | tail -n 1)"; fi
if printf 'scratch\n' > "$NOTE"; then
  say ALLOWED "write $NOTE (the cell's own private /tmp, discarded when the cell ends)"
fi

echo "-- (b) read secrets outside the project --"
try_read "$SECRET" "only the project was shared; no other host file is in the cell"
try_read /etc/shadow "an empty mode-000 file is mounted over it"
try_list /root "root's home is not in the cell"

echo "-- (c) write outside the project --"
try_write "$OUT_USR" "/usr is mounted read-only"
try_write "$OUT_ETC" "/etc is mounted read-only"
try_write "$HOSTHOME/.bashrc" "the host home is not in the cell"

echo "-- (d) reach the network --"
say INFO "network interfaces in the cell: $(ip -brief link | awk '{printf "%s%s (%s)", s, $1, $2; s=", "}')"
if err=$(python3 -c '
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()
except OSError as e:
    sys.exit(e.strerror or str(e))' "$PORT" 2>&1); then
  say ALLOWED "connect to 127.0.0.1:$PORT, the host's service (the cell should have no network!)"
else
  say DENIED "connect to 127.0.0.1:$PORT, the host's service ($err: the cell has its own network namespace)"
fi

echo "-- (e) secrets in the environment, other processes --"
if [ -n "${DEMO_API_KEY+set}" ]; then say ALLOWED "see \$DEMO_API_KEY (it leaked into the cell!)"
else say DENIED "see \$DEMO_API_KEY (not passed in; the cell's environment holds only: $(env | cut -d= -f1 | sort | tr '\n' ' ' | sed 's/ $//'))"; fi
n=$(find /proc -maxdepth 1 -name '[0-9]*' | wc -l)
if [ "$n" -lt 20 ] && [ "$n" -lt "$HOST_PROCS" ]; then
  say DENIED "see the host's processes (the cell shows $n, all the agent's own; the host runs $HOST_PROCS)"
else
  say ALLOWED "see the host's processes ($n visible)"
fi
AGENT
)

RUN_FLAGS=(--as "$DEMO_UID" --rw "$PROJECT" --net none --cwd "$PROJECT" --env PYTHONDONTWRITEBYTECODE=1 --timeout 120)
AGENT_ARGS=(agent "$PROJECT" "$SECRET" "$HOSTHOME" "$PORT" "$TAG" "$HOST_PROCS" "$OUT_USR" "$OUT_ETC" "$CELL_TMP_NOTE")

section "3. What agentcell will do: agentcell run --explain (prints the plan, runs nothing)"
info "Every step below is done by agentcell (as root) before the agent starts; the agent itself starts at execve."
info "From the host the cell gets only the system_ro dirs (read-only, secrets masked) and the project (rw);"
info "/tmp, /home, /dev, /proc and the rest are fresh and empty, private to this cell."
echo
"$AGENTCELL" run --explain "${RUN_FLAGS[@]}" -- sh -c "$AGENT_SCRIPT" "${AGENT_ARGS[@]}" \
  | sed "s|^   command: .*|   command: sh -c AGENT_SCRIPT ${AGENT_ARGS[*]}   (AGENT_SCRIPT: see demo.sh)|"

section "4. The agent runs inside the cell"
info "\$ .venv/bin/agentcell run ${RUN_FLAGS[*]} -- sh -c \"\$AGENT_SCRIPT\" ..."
echo
touch "$WS/started"
cell_rc=0
"$AGENTCELL" run "${RUN_FLAGS[@]}" -- sh -c "$AGENT_SCRIPT" "${AGENT_ARGS[@]}" </dev/null >"$WS/cell.out" 2>&1 \
  || cell_rc=$?
cat "$WS/cell.out"

# ---- 5. verify, from the host -------------------------------------------------------------------------------
section "5. Checking from the host"
problems=()
line_for() { grep -F -- "$1" "$WS/cell.out" | head -n 1 || true; }
expect() {  # $1: ALLOWED|DENIED, $2: the attempt's description, as the agent prints it
  local line
  line=$(line_for "$(printf '%-8s %s' "$1" "$2")")
  if [ -n "$line" ]; then return 0; fi
  line=$(line_for " $2")
  problems+=("expected $1 for '$2', got: ${line:-no such line}")
}
[ "$cell_rc" -eq 0 ] || problems+=("agentcell run exited with $cell_rc (see its output above)")
expect ALLOWED "edit project/README.md"
expect DENIED "read $SECRET"
expect DENIED "read /etc/shadow"
expect DENIED "list /root"
expect DENIED "write $OUT_USR"
expect DENIED "write $OUT_ETC"
expect DENIED "write $HOSTHOME/.bashrc"
expect DENIED "connect to 127.0.0.1:$PORT"
expect DENIED "see \$DEMO_API_KEY"
expect DENIED "see the host's processes"
! grep -q "FAKE-DEMO-KEY-NOT-REAL" "$WS/cell.out" || problems+=("the secret's content appeared in the cell's output")

check() {  # $1: description, then a command that must succeed
  local what=$1
  shift
  if "$@"; then info "ok    $what"; else info "FAIL  $what"; problems+=("$what: not so"); fi
}
absent() { [ ! -e "$1" ] && [ ! -L "$1" ]; }
check "the agent's edit landed in $PROJECT/README.md" grep -q "inside an agentcell cell (run $TAG)" "$PROJECT/README.md"
check "the edit is owned by $DEMO_USER, not root" test "$(stat -c %U "$PROJECT/README.md")" = "$DEMO_USER"
changed=$(diff -rq examples/demo-project "$PROJECT" || true)
check "only README.md differs from examples/demo-project" \
  test "$changed" = "Files examples/demo-project/README.md and $PROJECT/README.md differ"
info "      README.md now ends with: $(tail -n 1 "$PROJECT/README.md")"
check "the fake secret is unchanged" test "$(sha256sum < "$SECRET")" = "$SECRET_SUM"
touched=$(find /etc /home /root /tmp /var/tmp /opt -xdev -uid "$DEMO_UID" -newer "$WS/started" \
  ! -path "$PROJECT" ! -path "$PROJECT/*" 2>/dev/null | head -n 5 || true)
check "no file in /etc, /home, /root, /tmp, /var/tmp or /opt outside the project was written by $DEMO_USER" \
  test -z "$touched"
check "$HOSTHOME still holds only .ssh" test "$(ls -A "$HOSTHOME")" = ".ssh"
check "$OUT_USR does not exist" absent "$OUT_USR"
check "$OUT_ETC does not exist" absent "$OUT_ETC"
check "$CELL_TMP_NOTE does not exist on the host (it lived in the cell's own /tmp)" absent "$CELL_TMP_NOTE"
leftover=$(ps -o pid= -u "$DEMO_UID" || true)
check "no process of $DEMO_USER is left running" test -z "$leftover"

# ---- 6. the same project through a whole session ------------------------------------------------------------
section "6. A whole session: agentcell session start --harness scripted"
info "plan -> policy -> backup -> a per-session account -> the cell, watched -> terminate at the first escape"
info "attempt -> delete the account -> audit. The scripted agent edits the code and its tests, runs the tests,"
info "then reads a credential in its home (a decoy the monitor planted): the session must end there."
export AGENTCELL_STATE_DIR=$WS/session-state  # the demo's sessions, checkpoints, backups and audit trail
mkdir -m 700 "$AGENTCELL_STATE_DIR"
cat > "$WS/steps.txt" <<STEPS
edit greet.py 'Hello, ' 'Hi, '
edit test_greet.py 'Hello, Ada!' 'Hi, Ada!'
edit test_greet.py 'Hello, world!' 'Hi, world!'
run python3 -B -m unittest -q
read ~/.ssh/id_ed25519
write greet.py 'after the escape: must never be written'
STEPS
sed 's/^/   | /' "$WS/steps.txt"
info "\$ .venv/bin/agentcell session start --harness scripted --project $PROJECT --wall-clock 120 --json -- steps.txt"
echo
session_rc=0
(cd "$PROJECT" && "$AGENTCELL" session start --harness scripted --project "$PROJECT" --wall-clock 120 --json \
  -- "$WS/steps.txt" </dev/null >"$WS/session.out" 2>"$WS/session.err") || session_rc=$?
sed '$d' "$WS/session.out"
cat "$WS/session.err"
SUMMARY=$(tail -n 1 "$WS/session.out")
field() { printf '%s' "$SUMMARY" | /usr/bin/python3 -c "import json, sys; print(json.load(sys.stdin).get('$1') or '')"; }
SID=$(field session)
echo
info "the summary (the last line of --json): status=$(field status) escape_target=$(field escape_target)"
check "the session was terminated at the escape attempt (exit 120)" test "$session_rc" -eq 120
check "the escape was the decoy credential" test "$(field escape_target | sed 's|.*/||')" = "id_ed25519"
check "the agent's tests passed before that" grep -q "ALLOWED: ran python3 -B -m unittest -q" "$WS/session.out"
check "nothing ran after the escape attempt" \
  test "$(grep -c 'must never be written' "$PROJECT/greet.py" || true)" = "0"
check "the per-session account $(field os_user) is gone" sh -c "! getent passwd '$(field os_user)' >/dev/null"
echo
info "\$ agentcell audit show --session $SID   (the hash-chained trail; verified next)"
"$AGENTCELL" audit show --session "$SID" "$AGENTCELL_STATE_DIR/audit/audit.jsonl" | sed 's/^/   /' | cut -c1-160
check "the audit trail holds the escape and verifies" sh -c \
  "grep -q '\"event\":\"session.escape\"' '$AGENTCELL_STATE_DIR/audit/audit.jsonl' &&
   '$AGENTCELL' audit verify '$AGENTCELL_STATE_DIR/audit/audit.jsonl' >/dev/null"
echo
info "\$ agentcell session diff $SID"
"$AGENTCELL" session diff "$SID" | sed 's/^/   /'
check "session diff shows the agent's two edits" \
  test "$("$AGENTCELL" session diff "$SID" | grep -c '^M ')" = "2"
info "\$ agentcell session restore $SID"
"$AGENTCELL" session restore "$SID" 2>&1 | sed 's/^/   /'
check "session restore put greet.py and test_greet.py back" \
  test "$(diff -rq examples/demo-project "$PROJECT" | grep -c -e greet.py -e test_greet.py || true)" = "0"

section "Summary"
FINISHED=1
allowed=$(grep -c '^ALLOWED ' "$WS/cell.out" || true)
denied=$(grep -c '^DENIED ' "$WS/cell.out" || true)
if [ ${#problems[@]} -eq 0 ]; then
  echo "PASS: the agent edited its project ($allowed attempts ALLOWED, all inside the cell)"
  echo "      and every one of its $denied attempts to reach outside was DENIED:"
  echo "      secrets outside the project, /etc/shadow, /root, writes to /usr, /etc and a home directory,"
  echo "      the host's loopback service, the exported DEMO_API_KEY, the host's processes."
  echo "      It ran as $DEMO_USER (uid $DEMO_UID), never as root. Nothing outside the project changed."
  echo "      Then a whole session: backed up, run as a per-session account, terminated at its first escape"
  echo "      attempt, audited; its edits shown by 'session diff' and undone by 'session restore'."
  exit 0
fi
echo "FAIL: the cell did not behave as expected:"
for p in "${problems[@]}"; do echo "  - $p"; done
exit 1
