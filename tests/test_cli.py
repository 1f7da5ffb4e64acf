"""The command line's conventions: every option of every command is in its --help, and the shell
completion that is generated from the same parsers completes commands and options in a real bash."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from agentcell.cli import main
from agentcell.cli.common import commands, walk
from conftest import AGENTCELL


def _commands() -> list[object]:
    return [pytest.param(words, p, id=" ".join(words))
            for name, _summary, own in commands() if own is not None for words, p in walk(own, [name])]


def test_every_command_has_a_parser_of_its_own() -> None:
    assert {name for name, _summary, own in commands() if own is None} == set()


@pytest.mark.parametrize(("words", "parser"), _commands())
def test_help_exits_0_and_names_every_option_the_command_takes(
        words: list[str], parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main.main([*words, "--help"])
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    shown = capsys.readouterr().out
    assert code == 0 and "usage:" in shown, shown
    for action in parser._actions:  # noqa: SLF001
        if action.help != argparse.SUPPRESS:
            for option in action.option_strings:
                assert option in shown, f"'agentcell {' '.join(words)} --help' does not name {option}"


def test_the_top_level_help_names_every_command() -> None:
    p = subprocess.run([AGENTCELL, "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--version" in p.stdout, p
    assert all(f"  {name} " in p.stdout for name in main.COMMANDS), p.stdout


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of ``words``, as its completion function is called on TAB."""
    line = " ".join(words)
    code = (f"source {script}\n"
            f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; COMP_LINE='{line}'; COMP_POINT={len(line)}\n"
            "$(complete -p agentcell | sed -E 's/.* -F ([^ ]+) .*/\\1/') agentcell \"${COMP_WORDS[-1]}\" "
            "\"${COMP_WORDS[-2]}\"\n"
            "printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_bash_completes_commands_and_options_from_the_parsers(tmp_path: Path) -> None:
    p = subprocess.run([AGENTCELL, "completion", "bash"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    script = tmp_path / "agentcell.bash"
    script.write_text(p.stdout)
    assert _complete(script, "agentcell", "se") == ["session"]
    assert _complete(script, "agentcell", "run", "--allow-d") == ["--allow-domain"]
    assert "--no-monitor" in _complete(script, "agentcell", "mcp", "--no")
    assert _complete(script, "agentcell", "cell", "start", "--no-m") == ["--no-monitor"]
    assert _complete(script, "agentcell", "agent", "mount", "a") == ["add"]
    assert _complete(script, "agentcell", "completion", "") == ["bash", "zsh", "fish"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_get_a_script_naming_the_commands(shell: str) -> None:
    p = subprocess.run([AGENTCELL, "completion", shell], capture_output=True, text=True)
    assert p.returncode == 0 and "session" in p.stdout and "--allow-domain" in p.stdout, p.stderr


def test_an_unknown_shell_is_a_usage_error_of_one_line() -> None:
    p = subprocess.run([AGENTCELL, "completion", "tcsh"], capture_output=True, text=True)
    assert p.returncode == 125 and len(p.stderr.splitlines()) == 1 and "tcsh" in p.stderr, p
