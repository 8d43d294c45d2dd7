"""The trusted cache directory of the C kernel's libraries.

Directory: ``$DCMHA_CACHE_DIR``, else ``$XDG_CACHE_HOME/dcmha`` (an absolute
``XDG_CACHE_HOME``), else ``~/.cache/dcmha``; created with mode 0700. A library's name
``dcmha_<tag>_<key>`` carries a key over its sources, flags, each compiler's command line
and ``--version`` output, the CPU model and flags (``-march=native``) and the framework
version (jaxlib for the FFI library, TensorFlow for the ops). Each build writes the library
as ``<name>-<sha256 prefix>.so`` and then a record ``<name>.json`` with its file name, size
and SHA-256, each renamed into place (atomic), so a reader sees a whole record naming a
whole file. Before every load, and never after:

* the directory (symbolic links resolved) must belong to this user and not be writable by
  group or others, and every directory above it must belong to this user or root and not be
  writable by group or others unless sticky (``/tmp``), as ssh treats ``~/.ssh``;
* the record and the library must be regular files of this user, not writable by group or
  others;
* the library's size and SHA-256 must equal its record's.

A library that fails only the last rule (damaged: a full disk, a killed copy; or replaced)
is rebuilt in place and never opened. If the directory or an entry fails the ownership
rules, or the directory cannot be created or written, ``build`` builds the library in a
private temporary directory of the process (``mkdtemp``, 0700), loads it from there and
removes it at exit, with one ``KernelWarning`` per process saying why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from typing import Optional

__all__ = ["cache_dir"]

_RECORD_MAX_BYTES = 4096


class _Untrusted(Exception):
    """A cache entry that the ownership rules refuse (the cache is then not used)."""


def cache_dir() -> str:
    """The cache directory by the rules of the module docstring (not checked here)."""
    d = os.environ.get("DCMHA_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME", "")
        if not os.path.isabs(base):         # the XDG rule: a relative value is ignored
            base = os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "dcmha")
    return os.path.abspath(d)


def _ownership_problem(what: str, st) -> Optional[str]:
    """Why a file or directory (``os.stat`` result ``st``) cannot be trusted, or None."""
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = {0o020: "group", 0o002: "others", 0o022: "group and others"}[st.st_mode & 0o022]
        return f"{what} is writable by {who} (mode {st.st_mode & 0o7777:04o})"
    return None


def _trusted_dir(directory: str):
    """(the directory, resolved, None) when it can hold trusted libraries, else (None, why)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        real = os.path.realpath(directory)
        st = os.stat(real)
    except OSError as e:
        return None, f"it cannot be created ({e})"
    if not stat.S_ISDIR(st.st_mode):
        return None, "it is not a directory"
    why = _ownership_problem("it" if real == directory else real, st)
    if why:
        return None, why
    parent = real
    while os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
        try:
            st = os.stat(parent)
        except OSError as e:
            return None, f"the directory above it cannot be read ({e})"
        if st.st_uid not in (os.geteuid(), 0):
            return None, f"{parent} above it belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return None, (f"{parent} above it is writable by group or others "
                          f"(mode {st.st_mode & 0o7777:04o})")
    return real, None


def _open_entry(path: str):
    """A cache entry opened for reading (no link followed, no FIFO waited on) after the
    ownership rules, or None if it does not exist; raises ``_Untrusted``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Untrusted(f"{path} is a symbolic link") from None
        raise
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    why = (f"{path} is not a regular file" if not stat.S_ISREG(st.st_mode)
           else _ownership_problem(path, st))
    if why:
        f.close()
        raise _Untrusted(why)
    return f


def _sha256(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def _lookup(directory: str, name: str) -> Optional[str]:
    """The path of ``name``'s library in ``directory`` if its record is whole and the
    library matches it; None if either is missing or damaged (then it is rebuilt)."""
    record = _open_entry(os.path.join(directory, name + ".json"))
    if record is None:
        return None
    with record:
        raw = record.read(_RECORD_MAX_BYTES + 1)
    try:
        entry = json.loads(raw.decode("utf-8"))
        lib, size, digest = entry["library"], entry["size"], entry["sha256"]
        if not (isinstance(lib, str) and re.fullmatch(re.escape(name) + r"-[0-9a-f]{16}\.so", lib)
                and isinstance(size, int) and isinstance(digest, str)):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    path = os.path.join(directory, lib)
    f = _open_entry(path)
    if f is None:
        return None
    with f:
        if os.fstat(f.fileno()).st_size != size or _sha256(f) != digest:
            return None
    return path


def _install(directory: str, name: str, built: str) -> str:
    """Move the library file ``built`` into ``directory`` under its content name, then
    write its record; both atomically (rename). Returns the library's new path."""
    with open(built, "rb") as f:
        digest = _sha256(f)
        size = os.fstat(f.fileno()).st_size
    lib = f"{name}-{digest[:16]}.so"
    os.chmod(built, 0o755)          # whatever the umask: group / others must not write
    os.replace(built, os.path.join(directory, lib))
    fd, tmp = tempfile.mkstemp(prefix=".dcmha-record-", dir=directory)     # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"library": lib, "size": size, "sha256": digest}, f)
        os.replace(tmp, os.path.join(directory, name + ".json"))
    except BaseException:
        os.unlink(tmp)
        raise
    return os.path.join(directory, lib)

