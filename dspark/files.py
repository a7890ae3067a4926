"""Reading files that a broken copy or a hostile user may have replaced.

A store, a model folder or a config may hold a symlink to /dev/zero, a FIFO, or a file
grown sparse to terabytes: a plain `read()` of one allocates without end or waits
forever. The readers here open regular files only and never read more than the caller
expects. They raise `FileRefused`, whose message completes "<the file> ..."; callers
turn it into their own user-facing error.

Writing them whole is `dspark.fsio`'s.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


class FileRefused(Exception):
    """A file that is not a regular file, or is bigger than it may be."""


def open_regular(path: str | Path) -> io.FileIO:
    """`path` open for unbuffered reading, if it (or what a symlink points at) is a regular file.

    O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer, so it can be
    refused; on a regular file the flag changes nothing. The type is taken from the open file
    (fstat), so nothing can swap the file between the check and the read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(f"is not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'not a file')})")
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_upto(f: io.RawIOBase, n: int) -> bytes:
    """At most `n` bytes of `f` from where it stands: fewer only at the end of the file."""
    data = f.read(n)
    if not data or len(data) == n:
        return data  # the usual case: one read, no copy
    parts, got = [data], len(data)
    while got < n and (more := f.read(n - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The whole of regular file `path`, refused (FileRefused) if it is over `limit` bytes.

    Its size is checked before reading, and the read asks for one byte more than that size
    (a read allocates what it asks for), so a file that grows meanwhile is seen, never read on.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = read_upto(f, size + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise FileRefused(f"is {max(size, len(data))} bytes, more than the {limit} it may be")
        return data


def file_xxh3(path: str | Path, block: int = 8 << 20) -> str:
    """xxh3-128 of regular file `path`, streamed (~10 GB/s: cheap enough to check on every open)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open_regular(path) as f:
        buf = memoryview(bytearray(block))
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()
