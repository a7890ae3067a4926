"""Reading a Zarr store: random access by sample id, and sequential reads with read-ahead.

Chunk files are read and decoded directly (not through zarr's codec pipeline), bounded by what
the store says, never by the file; every sample's checksum is checked while it is decoded
(format.py says why this is safe and what damage looks like).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numcodecs.blosc
import numpy as np
import zarr

from dspark.connector.base import Sample, Source, VerifyReport
from dspark.connector.buffers import READS
from dspark.connector.checksum import SampleChecksum
from dspark.connector.encoding import bytes_per_token, decode
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest, weights_differ
from dspark.connector.zarr.format import (BLOSC_MAX_OVERHEAD, META_BYTES, SEGMENT_FIX, IndexEntry, chunk_path,
                                          segment_indexes)
from dspark.connector.zarr.verify import ZarrReport, note_repair, repaired_records
from dspark.core.errors import DamagedSample, StoreError
from dspark.core.files import FileRefused, open_regular, read_bounded, read_upto


class _ChunkDamaged(Exception):
    """A chunk file that is missing, not a regular file, or not the size its header says (never handed to Blosc)."""


@dataclass
class _Array:
    """One array's chunk files, read and decoded directly: the bytes zarr wrote, without its pipeline.

    zarr-python's codec pipeline costs ~10x the Blosc decode itself on ~1 MB chunks
    (asyncio, buffer wrappers, a copy into the selection); reading the chunk file and
    decoding it straight into the caller's array runs at Blosc's speed, releases the
    GIL in both the read and the decode (reader threads run in parallel), and stays
    the standard zarr v3 layout (default chunk keys, bytes + blosc codecs).
    """

    path: Path
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    sep: str  # of the chunk keys
    attributes: dict

    @classmethod
    def open(cls, path: Path) -> _Array:
        try:  # zarr reads its metadata whole, whatever it is: only a small regular file reaches it
            read_bounded(path / "zarr.json", META_BYTES)
        except FileRefused as e:
            raise StoreError(f"{path / 'zarr.json'} {e}", SEGMENT_FIX) from None
        a = zarr.open_array(path, mode="r")
        codecs = [type(c).__name__ for c in a.metadata.codecs]
        if codecs != ["BytesCodec", "BloscCodec"]:
            raise StoreError(f"array {path} is encoded with {codecs}, not dspark's bytes + blosc",
                             "it was not written by dspark: re-extract into a new store")
        return cls(path, tuple(a.chunks), np.dtype(a.dtype), a.metadata.chunk_key_encoding.separator,
                   dict(a.attrs))

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    def chunk_path(self, c: int) -> Path:
        return chunk_path(self.path, c, len(self.chunk_shape), self.sep)

    def where(self, c: int) -> str:
        return f"chunk {c} of {self.path.name} in segment {self.path.parent.name}"

    def open_chunk(self, c: int):
        """An open file of chunk `c`, the kernel told to read it ahead; _ChunkDamaged if it is missing
        or not a regular file."""
        try:
            f = open_regular(self.chunk_path(c))
        except FileNotFoundError:
            raise _ChunkDamaged(f"{self.where(c)} is missing") from None
        except FileRefused as e:
            raise _ChunkDamaged(f"{self.where(c)} {e}") from None
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)  # cold reads: I/O overlaps the decode
        return f

    def checked_size(self, c: int, f) -> int:
        """The size of chunk `c` (open as `f`), once its 16-byte Blosc header says this size for this
        array's chunk; else _ChunkDamaged. Nothing else of the file is read."""
        size = os.fstat(f.fileno()).st_size
        self._check_header(c, os.pread(f.fileno(), 16, 0), size)
        return size

    def _check_header(self, c: int, head: bytes, size: int) -> None:
        """_ChunkDamaged unless `head` is a Blosc header of this array's chunk, `size` bytes compressed.

        Blosc 1 trusts the length in its header, so a truncated chunk would decode past the end
        of its buffer (garbage, or a segfault) instead of failing; and a file longer than its
        header says (a sparse 20 GB one) is never read whole.
        """
        # Blosc 1 header: version, versionlz, flags, typesize, then nbytes, blocksize, cbytes (<I each)
        nbytes, cbytes = struct.unpack_from("<I4xI", head, 4) if len(head) >= 16 else (None, None)
        if nbytes is not None and (nbytes != self.chunk_bytes or cbytes > nbytes + BLOSC_MAX_OVERHEAD):
            raise _ChunkDamaged(f"{self.where(c)} has a damaged header (a chunk of {nbytes} bytes, "
                                f"{cbytes} compressed; this array's chunks hold {self.chunk_bytes})")
        if cbytes is None or size < cbytes:
            raise _ChunkDamaged(f"{self.where(c)} is truncated ({size} of {cbytes or '?'} bytes)")
        if size > cbytes:
            raise _ChunkDamaged(f"{self.where(c)} is longer than its header says ({size} of {cbytes} bytes)")

    def problem(self, c: int) -> str | None:
        """None if chunk `c` is a regular file of the size its header gives, else what is wrong.

        Reads 16 bytes, decodes nothing: cheap enough for every resume. A flipped byte
        inside a chunk needs the full read of `ZarrStore.damaged`.
        """
        try:
            with self.open_chunk(c) as f:
                self.checked_size(c, f)
        except _ChunkDamaged as e:
            return str(e)
        return None

    def decode(self, c: int, f, out: np.ndarray) -> None:
        """Decode chunk `c` (open as `f`) into `out`, a C-contiguous array of the chunk's shape.

        One fstat and one read: the header is checked in the bytes read, and a file bigger than
        any chunk of this array can be is never read (only its header, to say what is wrong).
        """
        size = os.fstat(f.fileno()).st_size
        if size > self.chunk_bytes + BLOSC_MAX_OVERHEAD:
            self._check_header(c, os.pread(f.fileno(), 16, 0), size)  # raises: damaged header, or too long
        data = read_upto(f, size)
        self._check_header(c, data[:16], len(data))
        numcodecs.blosc.decompress(data, out)  # cname, shuffle and sizes from the chunk's own header


@dataclass
class _Index:
    """One consistent view of the segment indexes (a refresh swaps the whole view at once)."""

    first: dict[int, IndexEntry]  # the first record of each id, in segment order
    others: dict[int, tuple[IndexEntry, ...]]  # later records of the same id (repairs, concurrent writers)
    damaged_records: list[tuple[str, int, int]]  # (segment, byte offset, valid records after it) failing their CRC
    chosen: dict[int, IndexEntry] = field(default_factory=dict)  # ids with several records: the valid one

    def records(self, sample_id: int) -> tuple[IndexEntry, ...]:
        return (self.first[sample_id], *self.others.get(sample_id, ()))


class _Segment:
    """The arrays of one segment (read side), with a small LRU of decoded partial chunks.

    A chunk a sample covers whole is decoded straight into the sample's array. Short
    samples share chunks: the cache makes sequential reads decode each shared chunk
    once instead of once per sample.
    """

    CACHE_CHUNKS = 8

    def __init__(self, path: Path, manifest: StoreManifest):
        m = manifest
        C, L = m.chunk_tokens, len(m.captured_layer_ids)
        shapes = {"hidden": (C, L, m.hidden_size), "token_ids": (C,),
                  **({"scales": (C, L)} if m.encoding == "fp8_e4m3" else {})}
        self.path = path
        self.arrays = {name: _Array.open(path / name) for name in shapes}
        for name, a in self.arrays.items():  # chunk buffers are sized by the manifest, not by a file
            if a.chunk_shape != shapes[name]:
                raise StoreError(f"array {a.path} has chunks of {a.chunk_shape}, the store's manifest says "
                                 f"{shapes[name]}", SEGMENT_FIX)
        self.chunk_tokens = C
        self.weights_hash = self.arrays["hidden"].attributes.get("verifier_weights_hash")  # None: from before
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, name: str, c: int, f) -> np.ndarray:
        key = (name, c)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        a = self.arrays[name]
        block = np.empty(a.chunk_shape, a.dtype)
        a.decode(c, f, block)
        with self._lock:
            self._cache[key] = block
            while len(self._cache) > self.CACHE_CHUNKS * len(self.arrays):
                self._cache.popitem(last=False)
        return block

    def read(self, name: str, start: int, length: int, digest: SampleChecksum | None = None) -> np.ndarray | None:
        """Tokens [start, start+length) of array `name` (None: the segment has no such array), fed to
        `digest` piece by piece as each chunk is decoded, while its bytes are still in cache,
        instead of a second pass over the whole sample.
        """
        if name not in self.arrays:
            return None
        a, C = self.arrays[name], self.chunk_tokens
        out = READS.empty((length, *a.chunk_shape[1:]), a.dtype)
        row = out.nbytes // max(1, length)
        chunks = range(start // C, (start + length - 1) // C + 1)
        files = []
        if digest is not None:
            digest.begin(out)
        try:
            for c in chunks:
                files.append(a.open_chunk(c))
            for c, f in zip(chunks, files):
                lo, hi = max(start, c * C), min(start + length, (c + 1) * C)
                piece = out[lo - start : hi - start]
                if hi - lo == C:
                    a.decode(c, f, piece)
                else:
                    piece[...] = self._cached(name, c, f)[lo - c * C : hi - c * C]
                if digest is not None:
                    digest.upto((hi - start) * row)
        finally:
            for f in files:
                f.close()
        if digest is not None:
            digest.end()
        return out


class ZarrStore(Source):
    """Reader: random access by sample id and a sequential iterator with read-ahead."""

    live = False

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.location = str(self.root)
        self.manifest = StoreManifest.load(self.root)
        self._segments: dict[str, _Segment] = {}
        self._seg_lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Re-read the segment indexes (picks up samples written since opening)."""
        first: dict[int, IndexEntry] = {}
        others: dict[int, list[IndexEntry]] = {}
        bad: list[tuple[str, int, int]] = []
        for seg, records, damaged in segment_indexes(self.root):
            bad += [(seg, off, after) for off, after in damaged]
            for sid, start, length, crc in records:
                e = IndexEntry(seg, start, length, crc)
                if sid in first:  # concurrent writers, or a repair: the first valid record is read
                    others.setdefault(sid, []).append(e)
                else:
                    first[sid] = e
        self._view = _Index(first, {k: tuple(v) for k, v in others.items()}, bad)

    @property
    def duplicates(self) -> int:
        """Records beyond the first for their sample id."""
        return sum(map(len, self._view.others.values()))

    @property
    def damaged_records(self) -> list[tuple[str, int, int]]:
        """(segment, byte offset, valid records after it) of every index record failing its CRC.

        The sample it held is missing (unless stored again elsewhere); the records after it are read.
        """
        return list(self._view.damaged_records)

    @property
    def sample_ids(self) -> list[int]:
        return sorted(self._view.first)

    def __len__(self) -> int:
        return len(self._view.first)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._view.first

    def entry(self, sample_id: int) -> IndexEntry:
        """The record a read uses: the first one, or the first that read back valid."""
        v = self._view
        if sample_id not in v.first:
            raise StoreError(f"sample {sample_id} is not in store {self.root}",
                             "extract it first (`dspark extract` resumes and fills gaps)")
        return v.chosen.get(sample_id, v.first[sample_id])

    def _segment(self, name: str) -> _Segment:
        with self._seg_lock:  # reader threads: open each segment's arrays once
            if name not in self._segments:
                self._segments[name] = _Segment(self.root / "segments" / name, self.manifest)
            return self._segments[name]

    def _read_entry(self, e: IndexEntry, check: bool):
        """(tokens, payload, scales, whether they match the record's checksum; True unchecked)."""
        seg = self._segment(e.segment)
        tokens = seg.read("token_ids", e.start, e.length).astype(np.int64)
        digest = SampleChecksum(self.manifest.checksum) if check else None
        if digest is not None:  # the order of `sample_checksum`: tokens, payload, scales
            digest.part(tokens)
        payload = seg.read("hidden", e.start, e.length, digest)
        scales = seg.read("scales", e.start, e.length, digest)
        return tokens, payload, scales, not check or digest.value() == e.crc

    def _read_raw(self, sample_id: int, check: bool = True):
        """(record, tokens, payload, scales) of the first record that reads back whole, else DamagedSample.

        `check` verifies the checksum; an id with several records is always checked
        until one has read back valid, so a repaired copy wins over a damaged one.
        """
        v = self._view
        if sample_id not in v.first:
            self.entry(sample_id)  # raises: not in the store
        records = v.records(sample_id)
        chosen = v.chosen.get(sample_id)
        if chosen is not None:
            records = (chosen, *(e for e in records if e is not chosen))
        check = check or (len(records) > 1 and chosen is None)
        problems = []
        for e in records:
            try:
                tokens, payload, scales, intact = self._read_entry(e, check)
            except _ChunkDamaged as exc:
                problems.append(str(exc))
                continue
            except Exception as exc:  # an undecodable chunk is damage, whatever Blosc raises
                problems.append(f"unreadable: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if not intact:
                problems.append("checksum mismatch")
                continue
            if len(records) > 1:
                v.chosen[sample_id] = e
            return e, tokens, payload, scales
        raise DamagedSample(sample_id, self.location, "; ".join(dict.fromkeys(problems)))

    def read(self, sample_id: int, check: bool = True) -> Sample:
        """The sample, its checksum verified (`check=False` skips that, not the decode).

        Raises DamagedSample for a sample indexed here that does not read back intact.
        """
        _, tokens, payload, scales = self._read_raw(sample_id, check)
        m = self.manifest
        return Sample(sample_id, tokens, decode(payload, scales, m.encoding, m.dtype))

    def iter_samples(self, ids: Iterable[int] | None = None, read_ahead: int = 4,
                     check: bool = True) -> Iterator[Sample]:
        """Samples in the given order, `read_ahead` of them fetched in background threads."""
        ids = list(self.sample_ids if ids is None else ids)
        with ThreadPoolExecutor(max(1, read_ahead)) as pool:
            pending = [pool.submit(self.read, i, check) for i in ids[:read_ahead]]
            for nxt in ids[read_ahead:] + [None] * len(pending):
                sample = pending.pop(0).result()
                if nxt is not None:
                    pending.append(pool.submit(self.read, nxt, check))
                yield sample

    def missing(self, ids: Iterable[int]) -> list[int]:
        v = self._view
        return [i for i in ids if i not in v.first]

    def damaged(self, sample_id: int) -> str | None:
        """None if the sample reads back with its checksum, else what is wrong."""
        try:
            self._read_raw(sample_id, check=True)
        except DamagedSample as e:
            return e.reason
        return None

    def chunk_damage(self) -> dict[int, str]:
        """Samples with no copy whose chunk files are all present and whole: the cheap check.

        One 16-byte read per chunk, nothing decoded, so every `dspark extract` resume
        can afford it. A flipped byte inside a chunk is found only by `damaged()`.
        """
        v, ok, out = self._view, {}, {}
        C = self.manifest.chunk_tokens
        for sid in sorted(v.first):
            problem = None
            for e in v.records(sid):
                problem = None
                for c in range(e.start // C, (e.start + e.length - 1) // C + 1):
                    for name, a in self._segment(e.segment).arrays.items():
                        key = (e.segment, name, c)
                        if key not in ok:
                            ok[key] = a.problem(c)
                        problem = problem or ok[key]
                if problem is None:
                    break
            if problem is not None:
                out[sid] = problem
        return out

    def fingerprint(self) -> str:
        """Identity of the content: manifest identity plus every sample's id, length and checksum.

        An id stored more than once with other bytes (a repair that did not reproduce
        the original exactly) adds its other checksums: the content is not the same.
        """
        h = hashlib.sha256(self.manifest.model_dump_json(include=set(IDENTITY_FIELDS)).encode())
        v = self._view
        for sid in sorted(v.first):
            seen = set()
            for e in v.records(sid):
                if (e.length, e.crc) not in seen:
                    seen.add((e.length, e.crc))
                    h.update(struct.pack("<qqI", sid, e.length, e.crc))
        return h.hexdigest()

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def info(self) -> dict:
        m = self.manifest
        tokens = sum(e.length for e in self._view.first.values())
        raw = tokens * bytes_per_token(len(m.captured_layer_ids), m.hidden_size, "raw", m.dtype)
        disk = self.disk_bytes()
        return {"store": str(self.root), "samples": len(self), "tokens": tokens,
                "segments": len(list((self.root / "segments").glob("*"))) if (self.root / "segments").exists() else 0,
                "duplicate_records": self.duplicates, "damaged_index_records": len(self._view.damaged_records),
                "raw_bytes": raw, "disk_bytes": disk,
                "ratio": round(raw / disk, 3) if disk else None, "manifest": m.model_dump(),
                "segments_with_other_weights": self.segments_with_other_weights()}

    def segments_with_other_weights(self) -> list[dict]:
        """Segments written (with --accept-other-weights) by a verifier whose weights differ from the manifest's."""
        v, out = self._view, []
        for name in sorted({e.segment for sid in v.first for e in v.records(sid)}):
            try:
                written_by = self._segment(name).weights_hash
            except Exception:  # a segment that cannot be opened: `store verify` reports its samples
                continue
            if weights_differ(self.manifest.verifier_weights_hash, written_by):
                out.append({"segment": name, "verifier_weights_hash": written_by})
        return out

    def verify(self, ids: Iterable[int] | None = None, expected: int | None = None, *, thorough: bool = True,
               workers: int = 4, progress: bool = False) -> ZarrReport:
        """Read every sample (or `ids`) back against its checksum, list the damaged index records no repair
        made good, and, given the prepared data's sample count, the samples the store lacks.

        `thorough=False` reads no sample: it finds what `chunk_damage` finds (missing or cut chunk files,
        16 bytes a chunk), the check every `dspark extract` resume affords.
        """
        from tqdm import tqdm

        ids = self.sample_ids if ids is None else [i for i in ids if i in self]
        if thorough:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                reasons = list(tqdm(pool.map(self.damaged, ids), total=len(ids), desc="verify", unit="sample",
                                    disable=not progress))
            damaged = {i: r for i, r in zip(ids, reasons) if r}
        else:
            wanted = set(ids)
            damaged = {i: r for i, r in self.chunk_damage().items() if i in wanted}
        noted = repaired_records(self.root)
        records = [r for r in self._view.damaged_records if r[:2] not in noted]
        missing = None if expected is None else self.missing(range(expected))
        return ZarrReport(len(self), damaged, records, len(self._view.damaged_records) - len(records), missing,
                          expected)

    def repaired(self, found: VerifyReport) -> None:
        """Note the damaged index records `found` listed as made good (verify.py's `note_repair`)."""
        if found.damaged_records:  # every sample is stored again: those records hide nothing any more
            note_repair(self.root, found.damaged_records, found.missing or ())


def open_source(*, store: str | Path, **_) -> ZarrStore:
    """The SOURCES factory (registry.py): a store folder, read back; the other options are a live source's."""
    return ZarrStore(store)
