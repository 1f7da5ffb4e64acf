"""The pydantic policy layer: plans compile to policies over real paths, and bad input is refused by name."""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentcell.cell.spec import DEFAULT_PATH, CellSpec, Identity
from agentcell.errors import PolicyError
from agentcell.policy import (
    EscapeEvent,
    Limits,
    SandboxPolicy,
    SessionPlan,
    compile_plan,
    explain,
    load_plan,
)

# Root invoked through sudo by an account that does not exist on the host: every test sees the same identity.
UID = 54321
HOST = {"SUDO_UID": str(UID), "SUDO_GID": str(UID), "LANG": "C.UTF-8", "API_TOKEN": "s3cret", "TERM": "xterm"}


def compile_(plan: SessionPlan, **kw: object) -> SandboxPolicy:
    return compile_plan(plan, environ=HOST, euid=0, **kw)  # type: ignore[arg-type]


def plan(*declared: Path | str, **kw: object) -> SessionPlan:
    return SessionPlan(harness="claude", declared_paths=[str(p) for p in declared], **kw)  # type: ignore[arg-type]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    p = tmp_path / "project"
    (p / "secrets").mkdir(parents=True)
    (p / "src").mkdir()
    return p


def test_declared_path_becomes_rw_and_an_excluded_path_inside_it_is_masked(project: Path) -> None:
    pol = compile_(plan(project, excluded_paths=[str(project / "secrets")]))
    assert pol.rw_paths == (os.path.realpath(project),)
    assert pol.masked_paths == (os.path.realpath(project / "secrets"),)
    assert pol.ro_paths == ()
    assert pol.write_paths == (os.path.realpath(project),)
    assert pol.os_user == pol.identity.user


def test_excluded_path_outside_every_declared_path_is_refused(project: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(PolicyError) as e:
        compile_(plan(project / "src", excluded_paths=[str(outside)]))
    assert e.value.field == "excluded_paths"


def test_excluding_a_declared_path_itself_is_refused(project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan(project, excluded_paths=[str(project)]))
    assert e.value.field == "excluded_paths"


def _ssh_dir(tmp_path: Path) -> str:
    d = tmp_path / ".ssh"
    d.mkdir()
    return str(d)


REFUSED: dict[str, Callable[[Path], str]] = {
    "root of the host": lambda tmp: "/",
    "a home dir itself": lambda tmp: "/root",
    "a credential store": _ssh_dir,
    "a system dir declared writable": lambda tmp: "/usr",
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_unsafe_declared_path_is_refused_by_name_unless_explicitly_allowed(what: str, tmp_path: Path) -> None:
    path = REFUSED[what](tmp_path)
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this host")
    with pytest.raises(PolicyError) as e:
        compile_(plan(path))
    assert e.value.field == "declared_paths"
    assert path in e.value.problem
    assert "allow_unsafe_paths = true" in e.value.fix
    pol = compile_(plan(path, allow_unsafe_paths=True))
    assert pol.rw_paths == (os.path.realpath(path),)


def test_credential_store_is_refused_even_read_only(tmp_path: Path, project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan(project, ro_paths=[_ssh_dir(tmp_path)]))
    assert e.value.field == "ro_paths"


def test_system_dir_read_only_is_accepted(project: Path) -> None:
    assert compile_(plan(project, ro_paths=["/usr"])).ro_paths == ("/usr",)


@pytest.mark.parametrize("unsafe", [False, True])
def test_missing_path_is_always_refused(tmp_path: Path, unsafe: bool) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan(tmp_path / "nope", allow_unsafe_paths=unsafe))
    assert e.value.field == "declared_paths"
    assert "does not exist" in e.value.problem


def test_symlinked_declared_path_resolves_to_its_target(project: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(project)
    assert compile_(plan(link)).rw_paths == (str(project.resolve()),)


def test_path_given_twice_in_different_roles_is_refused(project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan(project, ro_paths=[str(project)]))
    assert e.value.field == "ro_paths"


def test_same_plan_on_same_host_compiles_to_an_equal_policy(project: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    p = plan(project, excluded_paths=[str(project / "secrets")], ro_paths=["/usr"], scratch=str(scratch),
             network="loopback", limits=Limits(memory_bytes=2 << 30, cpu_percent=50, pids=64),
             env={"DEBUG": "1"}, keep_env=["API_TOKEN"])
    first, second = compile_(p), compile_(p.model_copy(deep=True))
    assert first == second
    assert first.model_dump_json() == second.model_dump_json()
    assert compile_(p.model_copy(update={"network": "none"})) != first


def test_identity_self_as_root_without_sudo_is_refused(project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_plan(plan(project), environ={"LANG": "C"}, euid=0)
    assert e.value.field == "identity"
    assert "identity = " in e.value.fix


def test_environment_is_scrubbed_and_only_named_variables_pass(project: Path) -> None:
    pol = compile_(plan(project, env={"DEBUG": "1"}))
    env = dict(pol.env)
    assert "API_TOKEN" not in env
    assert env["DEBUG"] == "1" and env["PATH"] == DEFAULT_PATH and env["LANG"] == "C.UTF-8"
    assert pol.env_allowlist == tuple(sorted(env))
    kept = compile_(plan(project, keep_env=["API_TOKEN"]))
    assert dict(kept.env)["API_TOKEN"] == "s3cret"


def test_env_key_that_is_not_a_variable_name_is_refused() -> None:
    with pytest.raises(ValidationError):
        plan("/x", env={"A=B": "c"})


def test_relative_paths_anchor_to_host_cwd_and_are_refused_without_one(project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan("src"))
    assert e.value.field == "declared_paths"
    pol = compile_(plan("src"), host_cwd=str(project))
    assert pol.rw_paths == (str((project / "src").resolve()),)


def test_cwd_is_kept_when_visible_else_first_declared_path_or_home(project: Path, tmp_path: Path) -> None:
    src = str((project / "src").resolve())
    assert compile_(plan(project), host_cwd=src).cwd == src
    pol = compile_(plan(project), host_cwd=str(tmp_path))
    assert pol.cwd == pol.identity.home
    assert compile_(plan(project)).cwd == str(project.resolve())


def test_host_firewall_needs_an_account_identity(project: Path) -> None:
    with pytest.raises(PolicyError) as e:
        compile_plan(plan(project, network="host-firewall"), environ={}, euid=4242)
    assert e.value.field == "network"


def test_to_cell_spec_carries_every_cell_field(project: Path, tmp_path: Path) -> None:
    try:
        pwd.getpwuid(UID)
        pytest.skip(f"uid {UID} exists on this host")
    except KeyError:
        pass
    home = tmp_path / "home"
    home.mkdir()
    real = str(project.resolve())
    pol = compile_(plan(project, excluded_paths=[str(project / "secrets")], ro_paths=["/usr"], home=str(home),
                        network="loopback", env={"DEBUG": "1"}))
    ident = Identity("uid", UID, UID, f"uid{UID}", f"/home/uid{UID}", (UID,))
    expected = CellSpec(
        identity=ident, rw_paths=(real,), ro_paths=("/usr",), masked_paths=(real + "/secrets",),
        scratch_dir=None, home_dir=str(home.resolve()), network="loopback",
        env=(("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8"), ("TERM", "xterm"), ("HOME", ident.home),
             ("USER", ident.user), ("DEBUG", "1")),
        cwd=real,
    )
    spec = pol.to_cell_spec()
    assert spec == expected
    assert spec.cell_id.endswith(pol.session_id)


def test_a_host_firewall_plan_carries_its_rules_to_the_cell(project: Path) -> None:
    pol = compile_(plan(project, network="host-firewall", identity="agent:nobody", allow_egress=["seed"],
                        allow_loopback=True))
    assert pol.firewall_rule and pol.to_cell_spec().egress == ("egress:seed", "loopback")
    with pytest.raises(PolicyError) as e:
        compile_(plan(project, network="host-firewall", identity="agent:nobody", allow_egress=["x:y:z"]))
    assert e.value.field == "allow_egress"


def test_a_proxy_plan_carries_its_rules_to_the_cell(project: Path) -> None:
    pol = compile_(plan(project, network="proxy", allow_domains=["*.example.com"], allow_presets=["pypi"],
                        deny_domains=["bad.example.com"], allow_ranges=["10.0.0.0/8"], resolver="192.0.2.53"))
    spec = pol.to_cell_spec()
    assert spec.network == "proxy" and spec.environ()["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert spec.egress == ("allow:pypi.org:443", "allow:files.pythonhosted.org:443", "allow:*.example.com",
                           "deny:bad.example.com", "range:10.0.0.0/8", "resolver:192.0.2.53")


@pytest.mark.parametrize(("fields", "field"), [({"network": "none", "allow_domains": ["a.example"]}, "network"),
                                               ({"network": "proxy", "allow_domains": ["bad name"]}, "allow_domains"),
                                               ({"network": "proxy", "allow_presets": ["nope"]}, "allow_presets")])
def test_bad_proxy_plans_are_refused(project: Path, fields: dict[str, object], field: str) -> None:
    with pytest.raises(PolicyError) as e:
        compile_(plan(project, **fields))
    assert e.value.field == field


def test_policy_is_frozen_and_rejects_unknown_fields(project: Path) -> None:
    pol = compile_(plan(project))
    with pytest.raises(ValidationError):
        pol.cwd = "/"
    with pytest.raises(ValidationError):
        SandboxPolicy.model_validate({**pol.model_dump(), "extra": 1})
    assert SandboxPolicy.model_validate_json(pol.model_dump_json()) == pol


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "agentcell.toml"
    f.write_text(textwrap.dedent(text))
    return f


def test_load_plan_reads_toml_and_anchors_relative_paths_to_the_file(project: Path) -> None:
    f = write(project, """
        harness = "codex"
        declared_paths = ["src"]
        network = "loopback"
        [limits]
        pids = 64
    """)
    p = load_plan(f)
    assert p.harness == "codex" and p.limits.pids == 64 and p.network == "loopback"
    assert p.declared_paths == [str(project / "src")]


@pytest.mark.parametrize(("body", "field"), [
    ('harness = "x"\ndeclared_paths = []\ndeclard_paths = ["/tmp"]\n', "declard_paths"),
    ('harness = "x"\ndeclared_paths = []\n[limits]\nmemry_bytes = 1\n', "limits.memry_bytes"),
    ('harness = "x"\ndeclared_paths = []\nwall_clock_limit_s = 0\n', "wall_clock_limit_s"),
    ('harness = "x"\ndeclared_paths = []\n[limits]\npids = true\n', "limits.pids"),
    ('harness = "x"\ndeclared_paths = [3]\n', "declared_paths.0"),
    ('harness = "x"\ndeclared_paths = []\nnetwork = "wide-open"\n', "network"),
    ('harness = "x"\ndeclared_paths = []\nidentity = "root; rm"\n', "identity"),
    ('harness = "x"\ndeclared_paths = []\nallow_unsafe_paths = "yes"\n', "allow_unsafe_paths"),
    ('declared_paths = []\n', "harness"),
])
def test_invalid_policy_file_is_one_line_naming_the_first_bad_field(tmp_path: Path, body: str,
                                                                    field: str) -> None:
    with pytest.raises(PolicyError) as e:
        load_plan(write(tmp_path, body))
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_policy_file_that_is_not_toml_or_missing_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError):
        load_plan(write(tmp_path, "harness = \n"))
    with pytest.raises(PolicyError):
        load_plan(tmp_path / "absent.toml")


def test_explain_shows_paths_and_variable_names_but_not_values(project: Path) -> None:
    pol = compile_(plan(project, excluded_paths=[str(project / "secrets")], keep_env=["API_TOKEN"]))
    text = explain(pol)
    assert str(project.resolve()) in text and str((project / "secrets").resolve()) in text
    assert "API_TOKEN" in text and "s3cret" not in text
    assert pol.session_id in text


def test_escape_event_defaults_and_forbids_unknown_keys() -> None:
    ev = EscapeEvent(session_id="s", operation="read", target="/etc/shadow", reason="not in read_paths",
                     source="landlock")
    assert ev.ts > 0 and ev.pid is None
    with pytest.raises(ValidationError):
        EscapeEvent(session_id="s", operation="teleport", target="x", reason="r", source="s")  # type: ignore[arg-type]


def test_session_ids_are_fresh_and_safe_for_kernel_object_names() -> None:
    assert plan("/x").session_id != plan("/x").session_id
    with pytest.raises(ValidationError):
        plan("/x", session_id="../../etc")


def test_importing_resolve_does_not_import_pydantic() -> None:
    code = ("import sys, agentcell.policy.resolve; assert 'pydantic' not in sys.modules, 'eager'; "
            "import agentcell.policy as p; p.SessionPlan; assert 'pydantic' in sys.modules, 'lazy'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plan_limits_reach_the_cell(project: Path) -> None:
    spec = compile_(plan(project, limits=Limits(memory_bytes=1 << 30, cpu_percent=50, pids=64))).to_cell_spec()
    assert (spec.memory_max, spec.cpu_percent, spec.pids_max) == (1 << 30, 50, 64)


def test_plan_landlock_and_allow_write_reach_the_cell(project: Path) -> None:
    (project / ".git").mkdir()
    pol = compile_(plan(project, landlock="best-effort", landlock_min_abi=7,
                        allow_write=[str(project / ".git")]))
    spec = pol.to_cell_spec()
    assert (spec.landlock, spec.landlock_min_abi) == ("best-effort", 7)
    assert spec.allow_write == (os.path.realpath(project / ".git"),)


def test_allow_write_outside_the_declared_paths_is_refused(project: Path, tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        compile_(plan(project, allow_write=[str(tmp_path)]))
    assert err.value.field == "allow_write"
