"""./demo.sh end to end: it passes, shows the denials and a whole session, and leaves no account and no
workspace behind."""
from __future__ import annotations

import glob
import os
import pwd
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="demo.sh needs root: it creates an account")


def _demo_accounts() -> set[str]:
    return {pw.pw_name for pw in pwd.getpwall() if pw.pw_name.startswith("ac-demo")}


def _demo_dirs() -> set[str]:
    return set(glob.glob("/tmp/agentcell-demo-*"))


def test_demo_passes_and_cleans_up() -> None:
    accounts_before, dirs_before = _demo_accounts(), _demo_dirs()
    # Run from another directory: demo.sh must find its repository by itself. The timeout only guards
    # against a hang (a fresh machine installs packages first); nothing here asserts on durations.
    p = subprocess.run([str(REPO / "demo.sh")], cwd="/", stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=1800)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr

    workspace = re.search(r"project copy: +(/tmp/agentcell-demo-\w+)/project", out)
    account = re.search(r"throwaway account: +(ac-demo[0-9a-f]{4}) ", out)
    assert workspace and account, out
    ws = workspace.group(1)

    assert "ALLOWED  edit project/README.md" in out
    assert f"DENIED   read {ws}/host-home/.ssh/id_ed25519 (" in out
    assert "DENIED   read /etc/shadow (" in out
    assert re.search(r"^DENIED   write /usr/local/bin/agentcell-demo-[0-9a-f]{4} \(", out, re.M), out
    assert re.search(r"^DENIED   write /etc/agentcell-demo-[0-9a-f]{4} \(", out, re.M), out
    assert f"DENIED   write {ws}/host-home/.bashrc (" in out
    assert "DENIED   see $DEMO_API_KEY (" in out
    assert "FAKE-DEMO-KEY-NOT-REAL" not in out
    # The session part: terminated at the decoy credential, audited, diffed and restored.
    for line in ("the session was terminated at the escape attempt (exit 120)", "nothing ran after the escape attempt",
                 "the audit trail holds the escape and verifies", "session diff shows the agent's two edits",
                 "session restore put greet.py and test_greet.py back"):
        assert f"ok    {line}" in out, line
    assert "PASS:" in out

    with pytest.raises(KeyError):
        pwd.getpwnam(account.group(1))
    assert not os.path.exists(ws)
    assert _demo_accounts() <= accounts_before, "demo.sh left an ac-demo* account behind"
    assert _demo_dirs() <= dirs_before, "demo.sh left a /tmp/agentcell-demo-* directory behind"
