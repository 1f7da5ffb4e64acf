"""A session's credential set: placeholders, bindings, what the proxy injects and what it refuses."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from agentcell.errors import PolicyError
from agentcell.network.credentials import CredentialSet, parse_bindings, placeholder, read_value, read_values

ANTHROPIC = "sk-ant-api03-" + "Ab9_xYz-" * 11 + "QQ"
GITHUB = "ghp_" + "a1B2c3D4e5" * 3 + "F6g7h8"


def classes(text: str) -> str:
    return re.sub(r"[a-z]", "a", re.sub(r"[A-Z]", "A", re.sub(r"[0-9]", "9", text)))


@pytest.mark.parametrize("value, prefix", [(ANTHROPIC, "sk-ant-api03-"), (GITHUB, "ghp_"),
                                           ("sk-proj-" + "x" * 40, "sk-proj-"), ("AIza" + "Q1" * 18, "AIza"),
                                           ("plainToken12345678", "")])
def test_a_placeholder_has_the_values_shape_and_nothing_of_it_but_its_prefix(value: str, prefix: str) -> None:
    p = placeholder(value)
    assert p != value and p.startswith(prefix) and len(p) == len(value)
    assert classes(p) == classes(value)
    assert placeholder(value) != p  # fresh per session


def test_a_value_too_regular_to_stand_in_for_is_refused() -> None:
    with pytest.raises(PolicyError, match="too regular"):
        placeholder("--------------")


def creds() -> CredentialSet:
    bindings = parse_bindings(["ANTHROPIC_API_KEY=api.anthropic.com:x-api-key,authorization",
                               "GH_TOKEN=github.example.test"])
    return CredentialSet.build({"ANTHROPIC_API_KEY": ANTHROPIC, "GH_TOKEN": GITHUB}, bindings)


def test_the_real_value_goes_only_to_its_host_in_its_header() -> None:
    c = creds()
    ph = c.cell_env()["ANTHROPIC_API_KEY"]
    assert ph != ANTHROPIC and c.hosts() == ("api.anthropic.com", "github.example.test")
    headers, why = c.inject("API.Anthropic.com.", "/v1/messages", [("X-Api-Key", ph), ("accept", "text/event-stream")])
    assert why == "" and headers == [("X-Api-Key", ANTHROPIC), ("accept", "text/event-stream")]
    headers, why = c.inject("api.anthropic.com", "/v1/messages", [("Authorization", f"Bearer {ph}")])
    assert why == "" and headers == [("Authorization", f"Bearer {ANTHROPIC}")]
    gh = c.cell_env()["GH_TOKEN"]  # bound to no header in particular: any
    headers, why = c.inject("github.example.test", "/o/r.git/info/refs", [("Authorization", f"token {gh}")])
    assert why == "" and headers == [("Authorization", f"token {GITHUB}")]
    untouched = [("accept", "*/*")]
    assert c.inject("elsewhere.example.test", "/", untouched) == (untouched, "")


@pytest.mark.parametrize("host, target, header, why", [
    ("evil.example.test", "/", "x-api-key", "sent to evil.example.test"),
    ("github.example.test", "/", "authorization", "sent to github.example.test"),
    ("api.anthropic.com", "/v1/messages?key={ph}", "accept", "in the URL"),
    ("api.anthropic.com", "/", "x-forwarded-for", "in the header x-forwarded-for"),
])
def test_a_placeholder_where_its_secret_is_not_bound_is_refused(host: str, target: str, header: str, why: str) -> None:
    c = creds()
    ph = c.cell_env()["ANTHROPIC_API_KEY"]
    headers = [(header, ph if "{ph}" not in target else "x")]
    out, said = c.inject(host, target.format(ph=ph), headers)
    assert why in said and out == headers and ANTHROPIC not in repr(out)


def test_values_never_show() -> None:
    c = creds()
    assert ANTHROPIC not in repr(c) and GITHUB not in repr(c) and ANTHROPIC not in str(c.secrets["ANTHROPIC_API_KEY"])
    assert ANTHROPIC not in repr(c.secrets["ANTHROPIC_API_KEY"])
    assert c.redact(f"curl -H 'x-api-key: {ANTHROPIC}'") == "curl -H 'x-api-key: <ANTHROPIC_API_KEY>'"
    assert c.found(f"body {c.cell_env()['GH_TOKEN']} end".encode()) == [c.secrets["GH_TOKEN"]]


def test_bindings_and_values_are_checked_with_a_line_naming_the_flag() -> None:
    with pytest.raises(PolicyError, match="--secret-host: 'NOEQUALS'"):
        parse_bindings(["NOEQUALS"])
    with pytest.raises(PolicyError, match="not a host name"):
        parse_bindings(["K=bad host"])
    with pytest.raises(PolicyError, match="is bound to no host"):
        CredentialSet.build({"K": GITHUB}, {})
    with pytest.raises(PolicyError, match="bound but not given"):
        CredentialSet.build({}, parse_bindings(["K=h.example.test"]))
    with pytest.raises(PolicyError, match="K is not set in the environment"):
        read_values(["K"], {})
    with pytest.raises(PolicyError, match="characters long"):
        read_values(["K"], {"K": "short"})
    with pytest.raises(PolicyError, match="unknown source 'vault'"):
        read_values(["K=vault:x"], {})
    assert read_values(["K=env:OTHER"], {"OTHER": GITHUB}) == {"K": GITHUB}


def test_a_value_from_a_file_or_a_command_run_as_the_person(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(GITHUB + "\nsecond line\n")
    assert read_value("K", f"file:{tmp_path / 'key'}", {}) == GITHUB
    with pytest.raises(PolicyError, match="cannot read"):
        read_value("K", f"file:{tmp_path / 'absent'}", {})
    assert read_value("K", "cmd:printf 'tok-%s-abcdefgh\\n' \"$(id -u)\"", {"PATH": os.defpath}) == \
        f"tok-{os.getuid()}-abcdefgh"
    if os.geteuid() == 0:  # (as the person whose keyring holds it, not as root)
        assert read_value("K", "cmd:printf 'tok-%s-abcdefgh' \"$(id -u)\"", {"PATH": os.defpath},
                          run_as=(65534, 65534)) == "tok-65534-abcdefgh"
    with pytest.raises(PolicyError, match="exited 3") as e:
        read_value("K", f"cmd:echo {GITHUB}; exit 3", {"PATH": os.defpath})
    assert GITHUB not in str(e.value)


def test_a_token_in_basic_credentials_is_injected_as_git_sends_it() -> None:
    import base64

    c = creds()
    gh = c.cell_env()["GH_TOKEN"]
    basic = "Basic " + base64.b64encode(f"x-access-token:{gh}".encode()).decode()
    headers, why = c.inject("github.example.test", "/o/r.git/git-receive-pack", [("Authorization", basic)])
    assert why == "" and headers == [("Authorization", "Basic " + base64.b64encode(
        f"x-access-token:{GITHUB}".encode()).decode())]
    out, why = c.inject("evil.example.test", "/", [("Authorization", basic)])
    assert "sent to evil.example.test" in why and out == [("Authorization", basic)]


def test_the_placeholder_is_swapped_only_where_it_is_the_credential_of_an_auth_header() -> None:
    c = CredentialSet.build({"K": GITHUB}, parse_bindings(["K=api.example.test"]))  # no header named
    ph = c.cell_env()["K"]
    for name, value in (("Authorization", f"Bearer {ph}"), ("x-api-key", ph), ("x-goog-api-key", f" {ph} ")):
        out, why = c.inject("api.example.test", "/", [(name, value)])
        assert why == "" and GITHUB in out[0][1], (name, value)
    for name, value, said in (("Host", ph, "in the header Host"), ("Origin", ph, "in the header Origin"),
                              ("x-note", ph, "in the header x-note"),
                              ("Authorization", f"Bearer {ph} {ph}", "inside a longer value"),
                              ("Authorization", f"Bearer {ph}xyz", "inside a longer value"),
                              ("Authorization", f"x{ph}", "inside a longer value")):
        out, why = c.inject("api.example.test", "/", [(name, value)])
        assert said in why and out == [(name, value)], (name, value, why)
    with pytest.raises(PolicyError, match="servers echo or follow"):
        parse_bindings(["K=api.example.test:host"])


def test_a_real_value_coming_back_is_seen_as_it_is_and_in_base64() -> None:
    import base64

    c = creds()
    assert c.leaked(b"...echo " + ANTHROPIC.encode() + b"...") is c.secrets["ANTHROPIC_API_KEY"]
    assert c.leaked(base64.b64encode(GITHUB.encode())) is c.secrets["GH_TOKEN"]
    assert c.leaked(c.cell_env()["GH_TOKEN"].encode()) is None
