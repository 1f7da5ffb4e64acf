"""What the benches that run sessions on a throwaway user's projects share (bench/caches.py,
bench/workspace.py): the user, a directory for the projects, a state directory of the bench's own; all
removed at the end, whatever happened (the sessions' teardown finished first)."""
from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

AGENTCELL = str(Path(sys.executable).parent / "agentcell")


@contextlib.contextmanager
def throwaway(user_prefix: str, name: str) -> Iterator[tuple[pwd.struct_passwd, Path, Path]]:
    """(the user's passwd entry, /tmp/agentcell-bench-NAME-…, its state/ for AGENTCELL_STATE_DIR)."""
    user = user_prefix + secrets.token_hex(2)
    subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", user], check=True)
    base = Path(tempfile.mkdtemp(prefix=f"agentcell-bench-{name}-"))
    state = base / "state"
    try:
        os.chmod(base, 0o755)
        state.mkdir(mode=0o700)
        yield pwd.getpwnam(user), base, state
    finally:
        subprocess.run([AGENTCELL, "session", "recover"], env={"AGENTCELL_STATE_DIR": str(state),
                                                              "PATH": "/usr/bin:/bin"}, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["userdel", user], capture_output=True)
