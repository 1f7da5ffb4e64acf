"""What the MCP server's and the LangChain tool's tools do in a live cell, written once: every file
operation is a command in the cell (``cat``, ``ls``), so it has the agent's rights there and no
other, and a path is never opened by the host."""
from __future__ import annotations

from ..api import CellCompleted, CellEnded, LiveCell

MAX_OUTPUT = 100_000  # characters of a command's output a tool result carries
MAX_FILE = 1 << 20  # bytes read_file returns


class ToolFailed(Exception):
    """The tool could not do it: the message is for the model (and the human reading its transcript)."""


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    return f"{text[:MAX_OUTPUT]}\n[... {len(text) - MAX_OUTPUT:,} more characters not shown]"


def _checked(r: CellCompleted) -> CellCompleted:
    if r.error:  # the cell ended under the command: an escape attempt (by it or another), or a stop
        raise ToolFailed(f"{r.error}; no further commands can run in this cell")
    return r


def _exec(cell: LiveCell, argv: list[str], **kw: object) -> CellCompleted:
    try:
        return _checked(cell.exec(argv, text=True, **kw))  # type: ignore[arg-type]
    except CellEnded as e:
        raise ToolFailed(f"the cell has ended: {e.reason}; no further commands can run in it") from None


def run_command(cell: LiveCell, command: str, timeout_s: float = 120.0, cwd: str | None = None) -> str:
    r = _exec(cell, ["sh", "-c", command], timeout=timeout_s, cwd=cwd or None)
    head = f"exit status {r.returncode}" + (f" (timed out after {timeout_s:g} s)" if r.timed_out else "")
    return _clip(f"{head}\n--- stdout ---\n{r.stdout!s}--- stderr ---\n{r.stderr!s}")


def read_file(cell: LiveCell, path: str) -> str:
    r = _exec(cell, ["head", "-c", str(MAX_FILE + 1), "--", path])
    if r.returncode:
        raise ToolFailed(str(r.stderr).strip() or f"cannot read {path}")
    text = str(r.stdout)
    return text if len(text) <= MAX_FILE else f"{text[:MAX_FILE]}\n[... truncated at {MAX_FILE:,} bytes]"


def write_file(cell: LiveCell, path: str, content: str) -> str:
    r = _exec(cell, ["sh", "-c", 'cat > "$1"', "sh", path], input=content)
    if r.returncode:
        raise ToolFailed(str(r.stderr).strip() or f"cannot write {path}")
    return f"wrote {len(content.encode())} bytes to {path}"


def list_files(cell: LiveCell, path: str = ".") -> str:
    r = _exec(cell, ["ls", "-la", "--", path])
    if r.returncode:
        raise ToolFailed(str(r.stderr).strip() or f"cannot list {path}")
    return _clip(str(r.stdout))
