"""Paths read from files (manifests, indexes, metadata, records) resolved inside their root, never outside.

A checkpoint, a model dir or an export dir is data someone else may have produced: a name in its
``manifest.json`` / ``model.safetensors.index.json`` / ``.metadata`` / ``export.json`` / ONNX graph
must not steer a read (or a copy into our outputs) anywhere on this machine. Every such name goes
through ``resolve_inside`` (or, where there is no root yet, the lexical ``check_relative``).

What is followed, and why:
- The name itself is checked lexically: a non-empty relative POSIX path, no ``..`` component, no
  backslash, no NUL. ``/etc/hostname``, ``../outside.safetensors`` and ``a/../../b`` are refused
  before the file system is touched.
- Directories on the way (every component but the last) must resolve inside the root: a directory
  symlink planted in a source would open a whole foreign tree to names from the file.
- The last component may be a symlink to a regular file inside the root, or, when the root is a
  Hugging Face cache snapshot (``.../snapshots/<revision>``), to a file in that repo's ``blobs/``
  dir: that is how the hub cache stores every file (``model.safetensors -> ../../blobs/<sha>``).
  A symlink anywhere else is refused, although one link names only one file: symlinks travel in
  git clones and tar files, and a ``tokenizer.json -> ~/.ssh/id_rsa`` in a downloaded model would
  otherwise be copied into the converted model dir, which users publish. (git-annex/DVC trees:
  copy the files with ``cp -L`` first.) A link to a directory, device or FIFO is refused too (a
  FIFO would block the reader forever, a device never ends).
- A name that does not exist is returned as is: each reader reports a missing file its own way.
The checks are made before the read, not atomically with it; a source changed while it is read
is outside what this guards against.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Literal

from titan_pipe.errors import UserError

FIX = "the file was written elsewhere or edited by hand; fix the entry or copy the source again from where it was made"


def _refuse(source: object, what: str, value: object, problem: str, fix: str) -> UserError:
    return UserError(f"{source}: {what} {value!r} {problem}; {fix}")


def check_relative(value: object, *, source: object, what: str = "path", fix: str = FIX) -> PurePosixPath:
    """``value`` as a relative POSIX path that cannot leave the directory it is relative to.

    Pure (no file system). ``source`` is the file the value was read from, for the message.
    """
    if not isinstance(value, str):
        raise _refuse(source, what, value, f"is a {type(value).__name__}, not a path", fix)
    if not value or "\0" in value:
        raise _refuse(source, what, value, "is empty or holds a NUL byte", fix)
    if "\\" in value:
        raise _refuse(source, what, value, "holds a backslash (paths here are POSIX, '/'-separated)", fix)
    p = PurePosixPath(value)
    if p.is_absolute():
        raise _refuse(
            source, what, value, "is an absolute path; paths in this file must be relative to its directory", fix
        )
    if ".." in p.parts:
        raise _refuse(
            source, what, value, "has a '..' component; paths in this file must stay inside its directory", fix
        )
    if not p.parts:  # "." or "./"
        raise _refuse(source, what, value, "names the directory itself, not a file in it", fix)
    return p


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _hub_blobs(real_root: Path) -> Path | None:
    """The blobs dir of a Hugging Face cache repo when ``real_root`` is one of its snapshots."""
    if real_root.parent.name == "snapshots" and (real_root.parent.parent / "blobs").is_dir():
        return real_root.parent.parent / "blobs"
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def resolve_inside(
    root: str | os.PathLike,
    relative: object,
    *,
    source: object,
    what: str = "path",
    kind: Literal["file", "dir", "any"] = "file",
    fix: str = FIX,
) -> Path:
    """``root / relative`` after the checks in this module's docstring; UserError (one line naming
    ``source``, the value and the fix) when ``relative`` would lead outside ``root``.

    kind "file": an existing target must be a regular file (a symlinked file is followed).
    kind "dir": an existing target must be a directory inside the root (symlinks included).
    kind "any": either of the two.
    The returned path is the lexical ``root / relative`` (as the user would recognise it).
    """
    rel = check_relative(relative, source=source, what=what, fix=fix)
    root = Path(root)
    real_root = root.resolve()
    path = root.joinpath(*rel.parts)
    try:
        parent = path.parent.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise _refuse(source, what, relative, f"goes through a symlink loop ({e})", fix) from None
    if not _inside(parent, real_root):
        raise _refuse(
            source, what, relative, f"goes through a symlinked directory that leads outside {root} (to {parent})", fix
        )
    try:
        st = os.stat(path)  # follows a final symlink
    except FileNotFoundError:
        if path.is_symlink():
            raise _refuse(source, what, relative, f"is a dangling symlink (to {os.readlink(path)})", fix) from None
        return path
    except OSError as e:
        raise _refuse(source, what, relative, f"cannot be examined ({os.strerror(e.errno or 0)})", fix) from None
    if kind == "any":
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        link = f" (a symlink to {os.readlink(path)})" if path.is_symlink() else ""
        raise _refuse(source, what, relative, f"is {_kind(st.st_mode)}{link}, not a regular file", fix)
    if kind == "file" and path.is_symlink():
        target = path.resolve()  # stat above succeeded, so no loop
        blobs = _hub_blobs(real_root)
        if not (_inside(target, real_root) or (blobs is not None and _inside(target, blobs))):
            raise _refuse(
                source,
                what,
                relative,
                f"is a symlink to {target}, outside {root}; copy the "
                "real files into the directory (cp -L) if you trust them",
                fix,
            )
    if kind == "dir":
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(source, what, relative, f"is {_kind(st.st_mode)}, not a directory", fix)
        if not _inside(path.resolve(), real_root):  # stat above succeeded, so no loop
            raise _refuse(
                source, what, relative, f"is a symlinked directory leading outside {root} (to {path.resolve()})", fix
            )
    return path


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: Path) -> list[tuple[int, int]]:
    """The (device, inode) of ``path`` (or, when it does not exist yet, of its nearest existing
    ancestor) and of every directory above it."""
    out, p = [], Path(os.path.abspath(path))
    while True:
        ident = _identity(p)
        if ident is not None:
            out.append(ident)
        if p.parent == p:
            return out
        p = p.parent


def overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same directory, or one lies inside the other, by what they are
    on disk (device and inode), not by their names: a bind mount or a link alias of a path is found as
    such before anything is written, not after."""
    ia, ib = _identity(a), _identity(b)
    if ia is not None and ia in _chain(b):
        return True
    return ib is not None and ib in _chain(a)
