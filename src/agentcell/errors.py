"""Errors agentcell reports to users, and the exit codes that go with them.

A user error is never a traceback: it is one line that names the field (or flag) and the fix.
"""
from __future__ import annotations

# Exit codes of agentcell's own failures. The command's own status passes through unchanged;
# these are chosen like podman/coreutils so a caller can tell "agentcell refused" from "the command failed".
EXIT_USAGE = 125  # bad flag, bad policy, refused identity: nothing was created, nothing ran
EXIT_SETUP = 123  # a launch step failed in the kernel (namespace, mount, identity): nothing ran
EXIT_TIMEOUT = 124  # --timeout expired; the whole cell was killed
EXIT_CANNOT_EXEC = 126  # the command exists but could not be executed
EXIT_NOT_FOUND = 127  # the command was not found inside the cell

EXIT_CODES_HELP = f"""exit status:
  the command's own status; a command killed by signal N gives 128+N
  {EXIT_USAGE}  agentcell refused the request (bad flag, bad path, identity); nothing ran
  {EXIT_SETUP}  a launch step failed in the kernel (the message names the step); nothing ran
  {EXIT_TIMEOUT}  --timeout expired; every process of the cell was killed
  {EXIT_CANNOT_EXEC}  the command could not be executed inside the cell
  {EXIT_NOT_FOUND}  the command was not found inside the cell
"""


MAX_LINE = 1200  # an error's line, at most (its start and its fix are kept)
MAX_NOTES = 20  # lines of an error's notes shown after it


def printable(text: str, keep: str = "") -> str:
    """``text`` as a terminal may be shown it: names and values come from the agent, so control
    characters (any not in ``keep``) are escaped, never sent to the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the process is, as SIGINT raises KeyboardInterrupt: every
    ``finally`` on the way out runs, so what the command made is taken down (a ``timeout``, a CI job
    cancelled, a closed terminal). Not an Exception: no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


_held = [0, 0]  # (how deep in held() the main thread is, the signal that came meanwhile)


def raise_on_termination() -> None:
    """From now on SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (in a :func:`held` block,
    at its end). Once: a second one while the first's cleanup runs is ignored (SIGINT, a person's ^C, still
    interrupts it). A child forked without exec (the launcher's, the warm launcher's) gets their default
    back: it must die of them, never unwind its parent's frames and run their cleanup."""
    import os
    import signal

    def terminated(signum: int, _frame: object) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        if _held[0]:
            _held[1] = _held[1] or signum
            return
        raise Terminated(signum)

    both = {signal.SIGTERM, signal.SIGHUP}
    masks: list[set[int]] = []  # the forking thread's own mask, put back on both sides of the fork

    def block() -> None:
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, both))

    def restore() -> None:
        if masks:
            signal.pthread_sigmask(signal.SIG_SETMASK, masks.pop())

    def default() -> None:  # (in the child, while both are still blocked: one that came waits for SIG_DFL)
        for s in both:
            signal.signal(s, signal.SIG_DFL)
        restore()  # (a cell's PID 1 is forked with them blocked on purpose: they stay so)

    for s in both:
        signal.signal(s, terminated)
    os.register_at_fork(before=block, after_in_parent=restore, after_in_child=default)


class held:  # noqa: N801 - used as a function: `with held():`
    """A step that must not be cut short by SIGTERM or SIGHUP (a teardown, or a command's start and the
    record that it started): one that comes meanwhile is raised as :class:`Terminated` when the block
    ends (also when it ends by an error of its own, which becomes the signal's context). A signal mask
    would not do: Python runs its handlers in the main thread whichever thread the kernel gave the signal
    to. In another thread it holds nothing (the main thread's own steps are its to hold)."""

    def __enter__(self) -> None:
        import threading

        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            _held[0] += 1

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        if not self.main:
            return
        _held[0] -= 1
        if not _held[0] and _held[1]:
            signum, _held[1] = _held[1], 0
            # (over an error of the step's own too: the signal is never lost, the error is its context)
            if exc_type is None or (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
                raise Terminated(signum)


def ignore_termination() -> None:
    """SIGTERM and SIGHUP ignored from here on (a forked process on its way out, whose end must pass
    nothing up its parent's frames). One that comes while this runs is taken here: after the first,
    :func:`raise_on_termination` raises no more."""
    import signal

    while True:
        try:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            return
        except Terminated:
            continue


def termination_held() -> int:
    """The SIGTERM or SIGHUP a :func:`held` block of the main thread has taken so far (0: none; always 0 in
    another thread, whose steps hold nothing)."""
    import threading

    return _held[1] if threading.current_thread() is threading.main_thread() else 0


class forked:  # noqa: N801 - used as a function: `with forked() as pid:`
    """``os.fork()`` with SIGTERM and SIGHUP held in the parent until the block ends, where one that
    came is raised: the block records the child first (one raised before that leaves the child to
    nobody), and one that comes during the fork is not taken in an at-fork hook, where Python prints it
    and drops it (the command would go on as though never stopped). The child has them as before."""

    def __enter__(self) -> int:
        import os
        import signal

        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            raise
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        return pid

    def __exit__(self, *_exc: object) -> None:
        import signal

        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)


class AgentcellError(Exception):
    """An error a user can fix. ``str()`` is the one-line message printed to them."""

    exit_code = EXIT_USAGE

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        msg = f"{self.field}: {self.problem}" if self.field else self.problem
        return f"{msg} ({self.fix})" if self.fix else msg


class PolicyError(AgentcellError):
    """The request or policy is refused before anything is created."""


class CellEnded(AgentcellError):
    """The live cell has ended (an escape, a stop, its host gone); ``reason`` says which."""

    exit_code = 137

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__("cell", reason, "open a new cell")


class LaunchError(AgentcellError):
    """A kernel step of the launch failed; ``field`` names the step."""

    exit_code = EXIT_SETUP


def mark_after_go(e: BaseException) -> None:
    """Mark an error raised once a command was let go (``after_go``): it may have run, so no one may start
    it again (a session's spawn retries only what failed before that), and what it planted is checked."""
    e.after_go = True  # type: ignore[attr-defined]


def report(prog: str, err: AgentcellError) -> int:
    """Print ``err`` as the one line a user sees and return its exit code."""
    import sys

    sys.stderr.write(f"{prog}: {_shown(err.line())}\n")
    report_notes(prog, err)
    return err.exit_code


def _shown(line: str) -> str:
    line = printable(line)  # paths in messages may be an agent's: no terminal escapes through them
    if len(line) > MAX_LINE:  # a value given in full (100,000 characters) is not repeated in full
        line = f"{line[:MAX_LINE * 2 // 3]}… ({len(line):,} characters) …{line[-MAX_LINE // 4:]}"
    return line


def report_notes(prog: str, err: BaseException) -> None:
    """What an error's handlers added to it (``add_note``): what a start that failed once its command was
    let go found on the control surface and moved aside, say. Bad input carries none."""
    import sys

    notes = [str(n) for n in getattr(err, "__notes__", ())]
    for note in notes[:MAX_NOTES]:
        sys.stderr.write(f"{prog}: {_shown(note)}\n")
    if len(notes) > MAX_NOTES:
        sys.stderr.write(f"{prog}: and {len(notes) - MAX_NOTES} more\n")
