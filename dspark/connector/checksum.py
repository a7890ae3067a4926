"""The checksum of one stored sample: its token ids, payload and fp8 scales, in that order.

Two kinds, named in the store's manifest:
- "xxh3_64" (stores written since it exists): xxh3-64 of each 1 MiB piece of each part, counted
  from the part's start, then xxh3-64 of those digests; its low 32 bits go in the index record.
  xxh3 runs at ~20 GB/s a core where zlib's CRC32 runs at ~4, and hashing whole pieces with the
  one-shot function releases the GIL (an `xxh3_64` object's `update` holds it), so reader threads
  hash in parallel. Pieces are fixed by position in the sample, not by chunk, so the same bytes
  give the same checksum wherever a segment puts them (a repair's copy included).
- "crc32" (stores written before): zlib's CRC32 over the bytes, chained across parts.

A reader feeds each part as it decodes it (`upto`), so the bytes are hashed while still in cache.
"""

from __future__ import annotations

import zlib
from typing import Literal

import numpy as np
import xxhash

Kind = Literal["crc32", "xxh3_64"]
PIECE = 1 << 20


class SampleChecksum:
    """Fed part by part, each part's bytes in order as they become final; `value()` at the end."""

    def __init__(self, kind: Kind):
        self.kind = kind
        self._crc = 0
        self._digests: list[int] = []
        self._part: memoryview | None = None
        self._done = 0

    def begin(self, part: np.ndarray) -> None:
        """Start the next part: a C-contiguous array whose bytes `upto` and `end` then hash."""
        self._part, self._done = memoryview(part.reshape(-1).view(np.uint8)), 0

    def upto(self, nbytes: int) -> None:
        """The part's first `nbytes` bytes are final: hash what can be hashed of them now."""
        if self.kind == "crc32":
            self._crc = zlib.crc32(self._part[self._done : nbytes], self._crc)
            self._done = max(self._done, nbytes)
            return
        for a in range(self._done, nbytes - PIECE + 1, PIECE):
            self._digests.append(xxhash.xxh3_64_intdigest(self._part[a : a + PIECE]))
            self._done = a + PIECE

    def end(self) -> None:
        """The whole part is final (its last, shorter piece included)."""
        n = len(self._part)
        self.upto(n)
        if self._done < n:
            self._digests.append(xxhash.xxh3_64_intdigest(self._part[self._done :]))
        self._part = None

    def part(self, data: np.ndarray) -> None:
        self.begin(np.ascontiguousarray(data))
        self.end()

    def value(self) -> int:
        if self.kind == "crc32":
            return self._crc
        return xxhash.xxh3_64_intdigest(np.asarray(self._digests, dtype="<u8").tobytes()) & 0xFFFFFFFF


def sample_checksum(kind: Kind, token_ids: np.ndarray, payload: np.ndarray, scales: np.ndarray | None) -> int:
    """The checksum of exactly the stored bytes of one sample (token ids as int64)."""
    h = SampleChecksum(kind)
    h.part(np.asarray(token_ids, dtype=np.int64))
    h.part(payload)
    if scales is not None:
        h.part(scales)
    return h.value()
