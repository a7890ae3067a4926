"""The output rule, one for every command that writes a file or folder it was named (`--output`, `--train`, ...).

An output is created new, or is the command's own earlier output, recognised by its record (prepare:
prepare.json; verifier import: dspark_import.json; holdout: TRAIN.summary.json; regenerate:
OUT.regenerate.json). It is never a file or folder of something else (`--force`, where a command has it,
overwrites only the command's own files), never one of the command's inputs or another of its outputs
(the same path, the same file through a link, or a folder holding one), never the current folder, and
never a file where a folder is expected or the other way round. `check_output` says so in one line
naming the flag, the path and the fix, before any expensive work (a model load, a tokenization).

Concurrent creators of one output are serialised: each holds `output_lock` (an flock on `.NAME.lock`
beside it) from its check to its last write, and a second one is refused in one line naming the holder.
A full disk mid-write is one line too (`writing`): what was written before it is kept.

Dependency-light (no torch, no numpy), so any layer may use it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark.core.errors import DsparkError, InputError

# A write that fails with one of these is the filesystem's state, not a bug: one line, not a traceback.
WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the filesystem is read-only", errno.EFBIG: "the file is too large for its filesystem"}
HOLDER_BYTES = 4096  # the lock file's holder line: far smaller


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file or folder: the same path once resolved, or one inode (a hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they point
        return a.resolve() == b.resolve()


def distinct(flag: str, path: Path, taken: Iterable[tuple[str, Path]], folder: bool = False, fix: str = "") -> None:
    """Refuse `path` if it is (or, for a folder, holds) a path this run reads or writes under another flag."""
    for other_flag, other in taken:
        if same_file(path, Path(other)):
            raise InputError(f"{flag} {path} is also {other_flag}: one file cannot be both",
                             fix or f"give {flag} a path of its own")
        if folder and Path(path).resolve() in Path(other).resolve().parents:
            raise InputError(f"{flag} {path} holds {other_flag} {other}, which writing {flag} would replace",
                             fix or f"give {flag} a new folder outside it")


def check_output(flag: str, path: Path, *, folder: bool, taken: Iterable[tuple[str, Path]] = (),
                 own: Callable[[Path], bool] | None = None, what: str = "", force: bool | None = None) -> None:
    """Refuse, in one line, an output path that breaks the rule (module docstring).

    `taken`: the run's inputs and other outputs, as (flag, path). `own(path)`: whether an existing non-empty
    `path` is the command's own earlier output (`what` describes it for the error); None: the command
    recognises it itself later (regenerate's resume). `force`: the command's --force (None: it has none).
    """
    path = Path(path)
    kind = "folder" if folder else "file"
    here = Path.cwd().resolve()
    if path.name in ("", ".", "..") or path.resolve() in (here, *here.parents):
        raise InputError(f"{flag} {path} is the current folder or one above it, which writing would replace",
                         f"give {flag} a new {kind} path")
    if path.exists() and path.is_dir() != folder:
        raise InputError(f"{flag} {path} is a {'file' if folder else 'folder'}, not a {kind}",
                         f"give {flag} a new {kind} path")
    distinct(flag, path, taken, folder)
    try:  # can we create files beside it (its temp, its lock)?
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise InputError(f"{flag} {path} is not writable ({e.strerror or e})",
                         f"give {flag} a path you can write to") from None
    if own is None or not path.exists() or (folder and not any(path.iterdir())) or own(path) or force:
        return
    raise InputError(f"{flag} {path} exists and is not {what}",
                     f"give {flag} a new path" + (", or pass --force to overwrite it" if force is not None else ""))


def written_files(folder: Path, names: Iterable[str], record: str) -> bool:
    """Whether `folder` holds `record` and nothing but `names`: a folder the command wrote, untouched since."""
    present = {p.name for p in folder.iterdir()}
    return record in present and present <= set(names)


class Lock:
    """An exclusive OS lock (flock) on the file `path`, held until `release()` or the end of the process.

    The file holds who holds it, for the line a refused process prints. The kernel drops a lock when its
    holder exits, kill -9 included, so a lock is never stale. `remove`: the holder deletes the file on release
    (an output's lock file should not outlive the write); a taker checks that the file it locked is still
    the one at `path`, since a lock on a file its last holder deleted locks nothing.
    """

    def __init__(self, path: Path, what: str, fix: str, error: type[DsparkError] = InputError, remove: bool = False):
        self.path, self.remove = Path(path), remove
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, HOLDER_BYTES, 0)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise error(f"cannot lock {what}: {e.strerror}",
                                "put it on a filesystem that supports file locks (flock)") from None
                raise error(f"{what} is in use by {_holder(holder)}", fix) from None
            try:
                st = os.stat(self.path, follow_symlinks=False)
                current = (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
        self.fd: int | None = fd
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "command": command if len(command) <= 160 else command[:159] + "…"}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            if self.remove:
                self.path.unlink(missing_ok=True)  # while still held: the next taker opens a new file
            os.close(self.fd)  # closing the file drops the lock
            self.fd = None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(text: bytes) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (ValueError, KeyError, TypeError):  # it has locked but not yet said who it is
        return "another process"


def output_lock(flag: str, path: Path) -> Lock:
    """The creation lock of output `path`: `.NAME.lock` beside it (`check_output` made its folder), so it works
    before `path` exists."""
    path = Path(path)
    return Lock(path.with_name(f".{path.name}.lock"), f"{flag} {path}",
                f"wait for it to finish (or stop it), or give {flag} another path", remove=True)


@contextmanager
def writing(path: Path, kept: str) -> Iterator[None]:
    """A write to `path` that the filesystem refuses (full, read-only) becomes one line saying what is `kept`."""
    try:
        yield
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise InputError(f"cannot write {path}: {WRITE_ERRNOS[e.errno]} ({e.strerror}); {kept}",
                         "free space there (or write elsewhere) and rerun the same command") from None
