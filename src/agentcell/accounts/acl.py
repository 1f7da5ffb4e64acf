"""Folder shares through POSIX ACLs: granted with setfacl, revoked without residue.

Granting adds one named-group entry for the agent's group ``agentcell-NAME`` (rwX or rX), and the
same as a default entry on directories so files either side creates later are covered too. Both
``setfacl`` calls walk physically (``-P``): a symlink inside the share — one an agent planted in an
earlier run, say, pointing at /etc/shadow — is never followed, so the grant cannot leave the tree.

Revoking removes those entries by the group's number (it works after the group is gone), and then
what ``setfacl -x`` leaves behind: the mask and the base default entries the grant created. Entries
that had an ACL of their own before the share are recorded when it is made (``prior_acl``: the ACL as
setfacl text, then the path) and get exactly that ACL back; the others lose what is left unless it
names someone (an entry added since, by hand). The parents of a share get no rights: an agent
reaches a share only through its cell's bind mount, so the human's home stays closed to the account.

ACLs are read straight from their extended attributes (``system.posix_acl_access`` and
``system.posix_acl_default``: a version word, then (tag, perm, id) entries), which is quicker than a
``getfacl`` per file and needs no parsing of text.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterator

from .commands import Commands

ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
TAG_USER, TAG_GROUP = 0x02, 0x08  # named entries; the rest are the base entries and the mask
CHUNK = 200  # paths per setfacl -b command


def entries(path: str, xattr: str = ACCESS) -> list[tuple[int, int, int]] | None:
    """The ACL's (tag, perm, id) entries, or None when the entry has no such ACL (or is a symlink)."""
    try:
        raw = os.getxattr(path, xattr, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOENT):
            return None
        raise
    if len(raw) < 4 or (len(raw) - 4) % 8:
        return None
    return [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw), 8)]


def has_acl(path: str) -> bool:
    return entries(path) is not None or entries(path, DEFAULT) is not None


def named_ids(path: str, tag: int = TAG_GROUP) -> set[int]:
    """Ids named in the access or default ACL (groups by default)."""
    out: set[int] = set()
    for x in (ACCESS, DEFAULT):
        out |= {i for t, _p, i in entries(path, x) or () if t == tag}
    return out


def tree(root: str) -> Iterator[str]:
    """``root`` and everything below it that setfacl -R -P touches: files and directories, never
    through a symlink."""
    st = os.lstat(root)
    yield root
    if not stat.S_ISDIR(st.st_mode):
        return
    for d, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            p = os.path.join(d, name)
            try:
                if not stat.S_ISLNK(os.lstat(p).st_mode):
                    yield p
            except FileNotFoundError:
                continue


_TAGS = {0x01: "u:", 0x02: "u:{}", 0x04: "g:", 0x08: "g:{}", 0x10: "m:", 0x20: "o:"}


def text(path: str) -> str:
    """The entry's ACL as setfacl text (numeric ids, default entries prefixed ``d:``), '' if none."""
    out = []
    for x, prefix in ((ACCESS, ""), (DEFAULT, "d:")):
        for tag, perm, ident in entries(path, x) or ():
            who = _TAGS.get(tag, "?").format(ident)
            out.append(f"{prefix}{who}:{'r' if perm & 4 else '-'}{'w' if perm & 2 else '-'}{'x' if perm & 1 else '-'}")
    return ",".join(out)


def prior_acl(root: str) -> list[str]:
    """``"<setfacl text> <path relative to root>"`` for every entry that has an ACL of its own."""
    return [f"{text(p)} {os.path.relpath(p, root)}" for p in tree(root) if has_acl(p)]


def grant(cmds: Commands, group: str, source: str, mode: str) -> None:
    perm = "rwX" if mode == "rw" else "rX"
    if os.path.isdir(source):
        cmds.run(["setfacl", "-R", "-P", "-m", f"g:{group}:{perm},d:g:{group}:{perm}", "--", source],
                 step="share")
    else:
        cmds.run(["setfacl", "-P", "-m", f"g:{group}:{perm.replace('X', '')}", "--", source], step="share")


def revoke(cmds: Commands, gid: int, source: str, prior: list[str]) -> None:
    """Remove the share's entries; strip what that leaves on entries that had no ACL; give those that
    had one exactly theirs back."""
    if not os.path.lexists(source) or os.path.islink(source):
        return
    if os.path.isdir(source):
        cmds.run(["setfacl", "-R", "-P", "-x", f"g:{gid},d:g:{gid}", "--", source], step="unshare")
    else:
        cmds.run(["setfacl", "-P", "-x", f"g:{gid}", "--", source], step="unshare")
    kept: dict[str, str] = {}
    for item in prior:
        acl_text, _, rel = item.partition(" ")
        kept[os.path.normpath(os.path.join(source, rel))] = acl_text
    bare = [p for p in tree(source) if p not in kept and has_acl(p) and not named_ids(p) | named_ids(p, TAG_USER)]
    for i in range(0, len(bare), CHUNK):
        cmds.run(["setfacl", "-P", "-b", "--", *bare[i:i + CHUNK]], step="unshare")
    for path, acl_text in kept.items():
        if os.path.lexists(path) and not os.path.islink(path) and text(path) != acl_text:
            cmds.run(["setfacl", "-P", "-b", "--", path], step="unshare")
            cmds.run(["setfacl", "-P", "-m", acl_text, "--", path], step="unshare")


def residue(gid: int, source: str) -> list[str]:
    """Entries below ``source`` whose ACL still names the group."""
    if not os.path.lexists(source) or os.path.islink(source):
        return []
    return [p for p in tree(source) if gid in named_ids(p)]
