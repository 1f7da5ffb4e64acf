"""A session's credentials: the real values stay with the supervisor and its proxy; the cell gets a
placeholder of the same shape for each, and the proxy swaps the real value in only where the secret
is bound (a host, and the request header it goes in).

A secret comes from the caller's environment, a file, or a command run on the host
(``--secret NAME=cmd:pass show api/anthropic``), and is bound to hosts (``--secret-host
NAME=api.anthropic.com``, or the harness profile's own API host and ``--api-base``'s). Its value is
never written: not to checkpoints, the audit trail, logs or ``session show`` (``repr`` hides it, and
:meth:`CredentialSet.redact` takes it out of any text that might carry it).

What the proxy decides (:meth:`CredentialSet.inject`): a request to a bound host gets the real value
where the cell put the placeholder in a header the binding allows; the placeholder anywhere else
(another host, a URL, a header the binding does not name, a body) is refused and is an escape
event: a placeholder is worth nothing outside, but sending it where it does not belong is what a
prompt-injected agent exfiltrating "the key" does.
"""
from __future__ import annotations

import base64
import os
import re
import secrets as _random
import string
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PolicyError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*|\[?[0-9A-Fa-f:.]+\]?")
# A key's recognisable start (``sk-ant-api03-``, ``sk-proj-``, ``ghp_``, ``github_pat_``, ``AIza``):
# kept, since a harness may check it; what follows is replaced, character class by character class.
PREFIX = re.compile(r"^(?:[a-z]{2,8}[-_])+(?:[a-z]{2,8}\d{0,2}[-_])?|^AIza")
MIN_VALUE = 8  # shorter is no credential (and a placeholder of it would be guessable)
MAX_VALUE = 16384
CMD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Secret:
    """One credential: ``name`` (its variable in the cell), ``value`` (never shown), ``placeholder``
    (what the cell sees), ``hosts`` it may go to (``http://HOST``: over plain HTTP, a gateway of the
    person's that has no TLS; else over HTTPS only), ``headers`` it may go in (empty: AUTH_HEADERS)."""

    name: str
    value: str = field(repr=False)
    placeholder: str
    hosts: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.name} (bound to {', '.join(self.hosts) or 'no host'})"

    def to(self, plain: bool) -> tuple[str, ...]:
        """The hosts it may go to over HTTPS, or (``plain``) over plain HTTP."""
        return tuple(h[7:] for h in self.hosts if h.startswith("http://")) if plain else \
            tuple(h for h in self.hosts if not h.startswith("http://"))


def placeholder(value: str) -> str:
    """A stand-in of the same shape: its known prefix kept, then each character replaced by a random
    one of its class (digit, lower, upper; anything else kept), never equal to the value. A harness
    that checks a key's format accepts it; nothing outside accepts it."""
    keep = PREFIX.match(value)
    head = keep.group(0) if keep else ""
    for _ in range(8):
        body = "".join(_random.choice(string.digits) if c.isdigit() else
                       _random.choice(string.ascii_lowercase) if c.islower() else
                       _random.choice(string.ascii_uppercase) if c.isupper() else c
                       for c in value[len(head):])
        out = head + body
        if out != value and value not in out:
            return out
    raise PolicyError("--secret", "the value is too regular to stand in for (nearly no letters or digits)",
                      "give the real credential")


def _host(text: str, flag: str) -> str:
    """A bound host: ``HOST`` (HTTPS) or ``http://HOST`` (plain HTTP: a gateway without TLS)."""
    host = text.strip().lower().rstrip(".")
    plain = host.startswith("http://")
    host = host.removeprefix("http://")
    if not HOST.fullmatch(host):
        raise PolicyError(flag, f"{text!r} is not a host name or address", "e.g. api.anthropic.com")
    return ("http://" if plain else "") + host.strip("[]")


def parse_bindings(flags: Iterable[str]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """``--secret-host NAME=HOST[,HOST…][:HEADER[,HEADER…]]``, each: NAME -> (hosts, headers: none
    named is AUTH_HEADERS; Host, Origin, Referer, Cookie and their kin are never allowed). A host
    ``http://HOST`` may get it over plain HTTP (a gateway without TLS), and only that way."""
    out: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for flag in flags:
        name, eq, rest = flag.partition("=")
        if not eq or not NAME.fullmatch(name) or not rest:
            raise PolicyError("--secret-host", f"{flag!r} is not NAME=HOST[,HOST][:HEADER]",
                              "e.g. --secret-host ANTHROPIC_API_KEY=api.anthropic.com:x-api-key")
        colon = re.search(r":(?!//)", rest)  # (the colon of http:// is not the one before the headers)
        hosts_text, headers_text = (rest[:colon.start()], rest[colon.end():]) if colon else (rest, "")
        hosts = tuple(_host(h, "--secret-host") for h in hosts_text.split(",") if h.strip())
        headers = tuple(h.strip().lower() for h in headers_text.split(",") if h.strip())
        if any(not re.fullmatch(r"[a-z0-9-]{1,64}", h) for h in headers):
            raise PolicyError("--secret-host", f"{headers_text!r} is not a list of header names",
                              "e.g. :authorization or :x-api-key")
        if NEVER & set(headers):
            raise PolicyError("--secret-host", f"{', '.join(sorted(NEVER & set(headers)))}: servers echo or follow "
                              "that header", "bind the secret to the header it authenticates with (authorization)")
        old_hosts, old_headers = out.get(name, ((), ()))
        out[name] = (tuple(dict.fromkeys((*old_hosts, *hosts))), tuple(dict.fromkeys((*old_headers, *headers))))
    return out


def read_value(name: str, source: str, env: Mapping[str, str], run_as: tuple[int, int] | None = None) -> str:
    """The value of ``--secret NAME[=SOURCE]``: SOURCE is ``env:VAR`` (the default: VAR = NAME),
    ``file:PATH`` (its first line) or ``cmd:COMMAND`` (its output's first line, run by ``/bin/sh`` on
    the host, as ``run_as`` (uid, gid) if given: the person's own keyring, not root's)."""
    kind, _, what = (source or f"env:{name}").partition(":")
    if kind == "env":
        value = env.get(what or name)
        if value is None:
            raise PolicyError("--secret", f"{what or name} is not set in the environment",
                              f"export it, or give --secret {name}=file:PATH or {name}=cmd:COMMAND")
    elif kind == "file":
        try:
            with open(what, encoding="utf-8") as f:
                value = f.read(MAX_VALUE + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError("--secret", f"{name}: cannot read {what} ({getattr(e, 'strerror', None) or e})",
                              "give a readable file holding the value") from None
    elif kind == "cmd":
        try:
            done = subprocess.run(["/bin/sh", "-c", what], capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, user=run_as[0] if run_as else None,
                                  group=run_as[1] if run_as else None, env=dict(env))
        except (OSError, subprocess.SubprocessError) as e:
            raise PolicyError("--secret", f"{name}: the command failed to run ({e})", "check the command") from None
        if done.returncode != 0:
            raise PolicyError("--secret", f"{name}: the command exited {done.returncode}",
                              "run it yourself to see why (its output is not shown: it may hold the value)")
        value = done.stdout
    else:
        raise PolicyError("--secret", f"{name}: unknown source {kind!r}", "use env:VAR, file:PATH or cmd:COMMAND")
    value = value.splitlines()[0].strip() if value.strip() else ""
    if not MIN_VALUE <= len(value) <= MAX_VALUE:
        raise PolicyError("--secret", f"{name}: the value is {len(value)} characters long",
                          f"a credential is {MIN_VALUE} to {MAX_VALUE} characters")
    if not value.isprintable() or not value.isascii():
        raise PolicyError("--secret", f"{name}: the value is not printable ASCII", "a header value must be")
    return value


class CredentialSet:
    """The session's secrets by name."""

    def __init__(self, items: Iterable[Secret] = ()) -> None:
        self.secrets: dict[str, Secret] = {s.name: s for s in items}

    @classmethod
    def build(cls, values: Mapping[str, str],
              bindings: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> CredentialSet:
        """From values by name and their bindings; a binding for a secret not given, or a secret bound
        nowhere, is an error (a secret no host may receive is a placeholder for nothing)."""
        for name in bindings:
            if name not in values:
                raise PolicyError("--secret-host", f"{name} is bound but not given", f"add --secret {name}")
        out = []
        for name, value in values.items():
            hosts, headers = bindings.get(name, ((), ()))
            if not hosts:
                raise PolicyError("--secret", f"{name} is bound to no host",
                                  f"add --secret-host {name}=HOST (the host that needs it)")
            out.append(Secret(name, value, placeholder(value), hosts, headers))
        return cls(out)

    def __repr__(self) -> str:
        return f"CredentialSet({', '.join(map(str, self.secrets.values()))})"

    def as_wire(self) -> list[dict[str, Any]]:
        """Values included: for a socket or a memfd to agentcell's own processes, never a file."""
        return [{"name": s.name, "value": s.value, "placeholder": s.placeholder, "hosts": list(s.hosts),
                 "headers": list(s.headers)} for s in self.secrets.values()]

    @classmethod
    def from_wire(cls, items: Iterable[Mapping[str, Any]]) -> CredentialSet:
        return cls(Secret(str(i["name"]), str(i["value"]), str(i["placeholder"]), tuple(map(str, i["hosts"])),
                          tuple(map(str, i["headers"]))) for i in items)

    def hosts(self) -> tuple[str, ...]:
        """Every host a secret is bound to over HTTPS: those the proxy terminates TLS for."""
        return tuple(dict.fromkeys(h for s in self.secrets.values() for h in s.to(plain=False)))

    def cell_env(self) -> dict[str, str]:
        """What the cell gets in place of the values."""
        return {s.name: s.placeholder for s in self.secrets.values()}

    def redact(self, text: str) -> str:
        """``text`` with every value replaced by ``<NAME>``."""
        for s in self.secrets.values():
            if s.value in text:
                text = text.replace(s.value, f"<{s.name}>")
        return text

    def found(self, data: str | bytes) -> list[Secret]:
        """The secrets whose placeholder ``data`` carries."""
        raw = data.encode("latin-1", "replace") if isinstance(data, str) else data
        return [s for s in self.secrets.values() if s.placeholder.encode() in raw]

    def inject(self, host: str, target: str, headers: list[tuple[str, str]], *,
               plain: bool = False) -> tuple[list[tuple[str, str]], str]:
        """A request to ``host`` for ``target`` (its path and query) with ``headers`` (``plain``: over
        plain HTTP): the headers with the real values in place of the placeholders where bound, and ""
        — or the headers unchanged and why the request must be refused (a placeholder where its secret
        is not bound). A placeholder is swapped only where it is the whole credential of a header the
        secret may go in: ``PH``, ``SCHEME PH`` (Bearer, token) or inside ``Basic`` credentials; never
        in a header that servers echo or follow (Host, Origin, Referer, Cookie), never in part of a
        longer value."""
        host = host.lower().rstrip(".")
        for s in self.found(target):
            return headers, f"the placeholder of {s.name} in the URL to {host} (it goes in a header, never a URL)"
        out = []
        for name, value in headers:
            basic = _basic(value)  # (git's token: Authorization: Basic base64(user:token))
            text = basic if basic is not None else value
            for s in self.found(text):
                if host not in s.to(plain):
                    how = "over plain HTTP " if plain else ""
                    return headers, f"the placeholder of {s.name} sent {how}to {host} (bound to {', '.join(s.hosts)})"
                allowed = s.headers or AUTH_HEADERS
                if name.lower() not in allowed or name.lower() in NEVER:
                    return headers, f"the placeholder of {s.name} in the header {name} (it may go in " \
                                    f"{', '.join(allowed)})"
                if not _whole(text, s.placeholder, basic is not None):
                    return headers, f"the placeholder of {s.name} inside a longer value of {name} (it goes " \
                                    "alone, after a scheme, or in Basic credentials)"
                text = text.replace(s.placeholder, s.value)
            if basic is not None and text != basic:
                value = value.split(" ", 1)[0] + " " + base64.b64encode(text.encode("latin-1")).decode()
            elif basic is None:
                value = text
            out.append((name, value))
        return out, ""

    def leaked(self, data: bytes) -> Secret | None:
        """The secret whose real value (as it is, or base64) ``data`` carries: a response must never."""
        for s in self.secrets.values():
            if s.value.encode() in data or base64.b64encode(s.value.encode()).rstrip(b"=") in data:
                return s
        return None


# Where a secret bound to no header in particular may go; where none ever goes (servers echo them back,
# redirect to them, or keep them).
AUTH_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
NEVER = frozenset({"host", "origin", "referer", "cookie", "location", "forwarded", "x-forwarded-host"})


def _whole(text: str, placeholder: str, basic: bool) -> bool:
    """The placeholder is the credential itself: the whole value, after a scheme word, or (in Basic
    credentials) the whole user or password."""
    text = text.strip()
    if basic:
        return placeholder in text.split(":", 1)
    scheme, _, rest = text.partition(" ")
    return text == placeholder or rest.strip() == placeholder and scheme.isalpha()


def off_the_list(hosts: Iterable[str], verdict: Callable[[str, int], tuple[bool, str]]) -> str | None:
    """The first bound host (``http://HOST``: at port 80, else 443) the proxy's rules (``verdict``:
    :meth:`agentcell.network.rules.Policy.name_verdict`) would not let through, or None."""
    for h in hosts:
        plain = h.startswith("http://")
        if not verdict(h.removeprefix("http://"), 80 if plain else 443)[0]:
            return h
    return None


def _basic(value: str) -> str | None:
    """The decoded credentials of ``Basic BASE64`` (``user:password``), or None."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme.lower() != "basic" or not rest:
        return None
    try:
        return base64.b64decode(rest.strip(), validate=True).decode("latin-1")
    except ValueError:
        return None


def read_values(names: Iterable[str], env: Mapping[str, str] | None = None,
                run_as: tuple[int, int] | None = None) -> dict[str, str]:
    """``--secret NAME[=SOURCE]`` flags read into values (the environment: this process's by default;
    ``run_as``: who runs a ``cmd:`` source)."""
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    for flag in names:
        name, _, source = flag.partition("=")
        if not NAME.fullmatch(name):
            raise PolicyError("--secret", f"{name!r} is not a variable name", "e.g. --secret ANTHROPIC_API_KEY")
        out[name] = read_value(name, source, env, run_as)
    return out
