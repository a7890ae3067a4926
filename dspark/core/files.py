"""Reading files that a broken copy or a hostile user may have replaced.

A store, a model folder or a config may hold a symlink to /dev/zero, a FIFO, or a file
grown sparse to terabytes: a plain `read()` of one allocates without end or waits
forever. The readers here open regular files only and never read more than the caller
expects. They raise `FileRefused`, whose message completes "<the file> ..."; callers
turn it into their own user-facing error.

Writing them whole is `dspark.core.fsio`'s.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
from pathlib import Path

_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


# Data files (chat JSONL, prompt and --exclude files) stream, so their size is free; what is held
# at once is one line (or one JSON-array record), and a gzip stream inflates at most so far.
MAX_LINE_BYTES = 64 << 20  # a line or record: a real conversation, even a LongBench context, is < 10 MB
GZIP_MAX_RATIO = 200  # real JSONL compresses 3-30 times; deflate's ceiling is ~1000 (a gzip bomb)
GZIP_MIN_BOUND = 1 << 20  # ... and a tiny gzip file may still inflate to this much


class FileRefused(Exception):
    """A file that is not a regular file, or is bigger than it may be; `fix` (optional) says what to do."""

    def __init__(self, what: str, fix: str | None = None):
        super().__init__(what)
        self.fix = fix


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


class DataReader:
    """A data file's bytes, gunzipped when it starts with gzip's magic bytes, with its reads bounded.

    Lines are at most `MAX_LINE_BYTES` (the line is refused, never read on); a gzip stream may
    inflate to `GZIP_MAX_RATIO` times the file's size (at least `GZIP_MIN_BOUND`): past that it is
    refused as a likely bomb, before the time to inflate it is spent. Both raise `FileRefused`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open_regular(path)
        try:
            size = os.fstat(self._file.fileno()).st_size
            zipped = read_upto(self._file, 2) == b"\x1f\x8b"
            self._file.seek(0)
            self._stream = gzip.GzipFile(fileobj=self._file, mode="rb") if zipped else io.BufferedReader(self._file)
        except BaseException:
            self._file.close()
            raise
        self.zipped = zipped
        self._limit = max(GZIP_MAX_RATIO * size, GZIP_MIN_BOUND) if zipped else None
        self._read = 0  # bytes handed out (inflated bytes of a gzip stream)
        self.lineno = 0  # lines handed out by readline / iteration

    def _count(self, data: bytes) -> bytes:
        self._read += len(data)
        if self._limit is not None and self._read > self._limit:
            raise FileRefused(f"decompresses to over {self._limit} bytes, {GZIP_MAX_RATIO} times its compressed "
                              "size (a gzip bomb?)",
                              f"if it is genuine, decompress it yourself (gunzip -k {self.path}), pass the plain file")
        return data

    def read(self, n: int) -> bytes:
        return self._count(self._stream.read(n))

    def readline(self) -> bytes:
        """The next line (b"" at the end), refused when it is over `MAX_LINE_BYTES`."""
        line = self._count(self._stream.readline(MAX_LINE_BYTES + 1))
        self.lineno += 1
        if len(line) > MAX_LINE_BYTES:
            raise FileRefused(f"line {self.lineno} is over {MAX_LINE_BYTES} bytes (dspark.core.files.MAX_LINE_BYTES)",
                              "split or delete that record")
        return line

    def __iter__(self):
        while line := self.readline():
            yield line

    def rewind(self) -> None:
        self._stream.seek(0)
        self._read = self.lineno = 0

    def close(self) -> None:
        self._stream.close()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
