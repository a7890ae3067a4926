"""Writing a file, a folder or a symlink that a reader may see: whole or not at all, and durably.

Every such write goes through here. The new content is written under a temporary name in the same
folder, `.NAME.<pid>-<random>.tmp` (`temp_path`), and renamed over NAME:

- Same folder: `rename` is atomic only within one filesystem, and a folder is one filesystem, while
  /tmp often is not (tmpfs). A reader opens NAME and gets the old file or the new one, never half.
  Hidden, and ending in `.tmp`, so a listing (`*.json`, `step-*`) skips it and a checker can refuse it.
- Write, flush, fsync the file, then rename, then fsync the folder. Without the first fsync the
  kernel may persist the rename before the data: after a power loss NAME is there but empty or
  short (ext4, xfs and btrfs all allow it). Without the folder fsync the rename itself may be lost:
  after a power loss NAME is the old file again, though the writer went on as if it were new.
- What a crash leaves. Before the rename: the old NAME, untouched, and a temp file beside it (a
  killed process cleans nothing; the pid in its name lets `remove_leftovers` tell whether its
  writer is gone). After the rename: the new NAME, complete (a power loss too keeps it once the
  folder fsync has returned). There is no point in between.
- A symlink at NAME is replaced, never followed: the temp file is created with O_EXCL (`open(..., "x")`
  refuses to open through a symlink), and `rename` replaces the directory entry, so a link from a
  result folder to /etc/passwd or to another run's file leaves that file as it was.

A folder (a checkpoint, a prepared data set, an imported model) is built the same way under a temp
name (`publishing`): every file in it is fsynced, then the folder, then it is renamed into place and
its parent fsynced. Replacing an existing folder takes two renames (old away, new in); a crash
between them leaves neither under NAME, both under temp names for `remove_leftovers`.

`durable=False` keeps the atomicity and skips the fsyncs, for data written at a rate fsync would
cap and whose loss in a power cut is detected and repaired downstream (the store's chunks).
Dependency-free, so any layer may use it; appending logs (metrics.jsonl, regenerate's output)
append on purpose and do not come here.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def temp_path(path: str | Path) -> Path:
    """A fresh temporary name for `path`, in its folder: `.NAME.<pid>-<random>.tmp`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def is_temp(name: str) -> bool:
    """Whether a file or folder name is one `temp_path` makes (a write in progress, or one cut short)."""
    return name.startswith(".") and name.endswith(".tmp")


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder `path` (a rename, a new file) survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some network and FUSE filesystems cannot sync a folder: nothing to do
            raise
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | Path, durable: bool = True) -> Iterator[BinaryIO]:
    """A new binary file that replaces `path` once written whole: a reader sees the old file or the new one,
    never half of one, and a symlink at `path` is itself replaced, never written through."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:  # "x" (O_CREAT | O_EXCL) makes a new file: it never opens a symlink's target
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the rename can be
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | Path, data: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `data` (text is written as UTF-8), whole or not at all."""
    with replacing(path, durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    """Replace `dst` with a copy of `src`'s content, whole or not at all."""
    with open(src, "rb") as s, replacing(dst) as d:
        shutil.copyfileobj(s, d, 1 << 20)


def write_new(path: str | Path, data: str | bytes) -> bool:
    """Create `path` holding `data` unless it exists; whether this call created it.

    Written whole under a temp name, then hard-linked to `path`: `link` fails if `path` exists, so of
    concurrent creators exactly one wins, and no one ever sees `path` half-written.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def replace_symlink(path: str | Path, target: str) -> None:
    """Point symlink `path` at `target` in one step: a reader follows the old link or the new one, never none."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, folders after what they hold."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            p = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(p).st_mode):  # a symlink holds no data to sync
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root)


@contextmanager
def publishing(path: str | Path, replace: bool = False, into: str | None = None) -> Iterator[Path]:
    """A new empty folder, renamed to `path` once the block has filled it without error; removed otherwise.

    `path` may be absent or an empty folder. `replace`: a folder or a symlink at `path` is swapped out and
    removed (two renames: a crash between them leaves nothing at `path`); a symlink is not followed, what
    it points at stays. A file at `path` is never replaced: the rename fails (NotADirectoryError).
    `into`: a non-empty folder at `path` is kept instead, with the new files renamed into it one by one over
    those of the same name, and the file named `into` (the record that marks the folder complete) removed
    first and put in last; the folder's other files stay as they were.
    """
    path = Path(path)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if into is not None and path.is_dir() and not path.is_symlink() and any(path.iterdir()):
            _move_into(tmp, path, into)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = None
        if replace and (path.is_symlink() or path.is_dir()):
            old = temp_path(path)
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)  # put the old folder back
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    if old is not None and old.is_symlink():
        old.unlink()
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _move_into(tmp: Path, path: Path, record: str) -> None:
    """Rename `tmp`'s files into folder `path`, `record` last; until then `path` holds no record, so a crash
    midway leaves a folder no reader takes for complete."""
    (path / record).unlink(missing_ok=True)
    fsync_dir(path)
    for p in tmp.iterdir():
        if p.name != record:
            os.replace(p, path / p.name)
    fsync_dir(path)  # the files are in before their record is
    os.replace(tmp / record, path / record)
    fsync_dir(path)


def remove_leftovers(path: str | Path, sole_writer: bool = False) -> list[Path]:
    """Remove the temp files and folders of `path` that writers killed mid-way left; return them.

    A temp whose writer still runs (the pid in its name is alive) is a write in progress and stays,
    unless `sole_writer`: the caller holds a lock no other writer of `path` can hold at the same time.
    """
    path = Path(path)
    ours = re.compile(re.escape(f".{path.name}.") + r"(\d+)-[0-9a-f]{8}\.tmp")  # not those of `path`.x
    gone = []
    for p in path.parent.iterdir() if path.parent.is_dir() else []:
        m = ours.fullmatch(p.name)
        if m is None or (not sole_writer and _alive(int(m[1]))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone; a number no pid can be
        return False
    except PermissionError:  # another user's process
        return True
    return True
