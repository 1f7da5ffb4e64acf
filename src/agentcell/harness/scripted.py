"""The scripted agent: a fake coding agent driven by a script, for the demo and the tests.

It runs inside the cell with the system's Python and the standard library only (the ``scripted``
profile hands this file's text to ``python3 -I -S -c``), so nothing of agentcell has to be visible
there. One step per line, words split like a shell's; ``#`` starts a comment::

    write PATH TEXT           create or replace a file (TEXT, then a newline); ~ is the cell's home
    append PATH TEXT          add a line to a file
    edit PATH OLD NEW         replace the first OLD in the file with NEW (the file must contain OLD)
    read PATH                 read a file
    run CMD [ARGS...]         run a command (no shell) and wait for it
    connect HOST PORT         open a TCP connection
    sleep SECONDS             wait (e.g. until the session's wall clock ends it)
    say TEXT                  print TEXT

Each step prints one line, ``ALLOWED`` or ``DENIED`` with what was tried; a denied step does not stop
the script (an agent tries something else). A malformed script exits 2 before its first step.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time

ARITY = {"write": 2, "append": 2, "edit": 3, "read": 1, "run": -1, "connect": 2, "sleep": 1, "say": -1}


def parse(text: str) -> list[list[str]]:
    steps = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise SystemExit(f"scripted agent: line {n}: {e}") from None
        if not words:
            continue
        want = ARITY.get(words[0])
        if want is None:
            raise SystemExit(f"scripted agent: line {n}: unknown step '{words[0]}' (one of {', '.join(ARITY)})")
        if (want >= 0 and len(words) - 1 != want) or (want < 0 and len(words) < 2):
            raise SystemExit(f"scripted agent: line {n}: '{words[0]}' takes {want if want >= 0 else 'some'} "
                             "argument(s)")
        steps.append(words)
    return steps


def step(words: list[str]) -> str:
    op, args = words[0], words[1:]
    if op in ("write", "append", "edit", "read"):
        args[0] = os.path.expanduser(args[0])  # ~ is the cell's home
    if op == "write":
        with open(args[0], "w") as f:
            f.write(args[1] + "\n")
        return f"wrote {args[0]}"
    if op == "append":
        with open(args[0], "a") as f:
            f.write(args[1] + "\n")
        return f"appended to {args[0]}"
    if op == "edit":
        with open(args[0]) as f:
            text = f.read()
        if args[1] not in text:
            raise ValueError(f"{args[0]} does not contain {args[1]!r}")
        with open(args[0], "w") as f:
            f.write(text.replace(args[1], args[2], 1))
        return f"edited {args[0]}"
    if op == "read":
        with open(args[0], "rb") as f:
            return f"read {args[0]} ({len(f.read())} bytes)"
    if op == "run":
        code = subprocess.run(args, stdin=subprocess.DEVNULL).returncode
        if code != 0:
            raise OSError(f"{shlex.join(args)} exited {code}")
        return f"ran {shlex.join(args)}"
    if op == "connect":
        with socket.create_connection((args[0], int(args[1])), timeout=5):
            return f"connected to {args[0]}:{args[1]}"
    if op == "sleep":
        time.sleep(float(args[0]))
        return f"slept {args[0]} s"
    return " ".join(args)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--text":
        sys.stderr.write("usage: scripted --text STEPS\n")
        return 2
    steps = parse(argv[1])
    for n, words in enumerate(steps, 1):
        try:
            line = f"step {n}: ALLOWED: {step(words)}"
        except (OSError, ValueError) as e:
            line = f"step {n}: DENIED: {shlex.join(words)}: {e}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o002)  # files the agent makes stay group-writable for the human it works for
    sys.exit(main(sys.argv[1:]))
