"""A chunked, compressed Zarr store of per-sample hidden states.

Layout (one store = one verifier, one layer set, one prepared data set):

    manifest.json                    StoreManifest, written once, exclusively
    segments/<writer>/               one zarr v3 group per writer session
        hidden     [CAP, L+1, H]     uint16 bits of bf16 (or uint8 fp8), token-major; its attributes
                                     record the writer's verifier weights hash
        scales     [CAP, L+1]        float32, fp8 only
        token_ids  [CAP]             int32
        index.bin                    32-byte records: sample_id, start, length, sample checksum, record crc

Why it is safe without locks:
- Each writer session owns a fresh segment, so no chunk is ever shared or
  rewritten: full chunks are written once, the last partial chunk at close.
  Each chunk is written through a temp file and a rename (fsio), as zarr's local store does.
- Arrays are created with a fixed huge capacity; nothing resizes, so array
  metadata is never rewritten after creation.
- A sample's index record is appended only after every chunk holding its
  tokens is written. Readers ignore a torn trailing record, so a sample is
  visible completely or not at all, whenever the writer dies.

Damage (a flipped byte, a lost or truncated chunk file, a damaged index record):
- Index records are fixed-size and each carries its own CRC: a damaged record is
  skipped and counted (`damaged_records`), and every record after it still reads.
- Every sample carries a checksum of its stored bytes (checksum.py: xxh3, or CRC32 in stores
  from before); `read` checks it by default (a few percent of the decode time, see README),
  hashing each piece right after decoding it. A missing or truncated chunk
  file is caught by its length before it is decoded; a garbled one fails the
  checksum or the decode; either way the reader gets `DamagedSample`, never
  wrong numbers.
- Reads are bounded by what the store says, never by the file: a chunk is read only
  if it is a regular file whose size is the one its Blosc header gives, and the
  header must describe this array's chunk. A chunk that is /dev/zero, a FIFO or
  a file grown sparse to 20 GB is a damaged sample, found without reading it.
  index.bin, manifest.json and zarr.json are read only as regular files of bounded
  size; anything else is a `StoreError`.
- Repair appends a fresh copy of a damaged sample to a new segment and leaves the
  damaged one where it is. An id with several records (a repair, or concurrent
  writers that both wrote it) reads from the first record that reads back valid,
  in segment order, so healthy segments are never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numcodecs.blosc
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec

from dspark.connector.base import Sample, Sink, Source, done, register_sink, register_source
from dspark.connector.buffers import READS
from dspark.connector.checksum import SampleChecksum, sample_checksum
from dspark.connector.encoding import bytes_per_token, decode, encode, stored_numpy_dtype
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest, weights_differ
from dspark.errors import DamagedSample, InputError, StoreError
from dspark.files import FileRefused, open_regular, read_bounded, read_upto
from dspark.fsio import replacing, write_atomic

_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
CAPACITY = 1 << 40  # tokens per segment; chunks are sparse, so this costs nothing
INDEX_RECORD = struct.Struct("<qqqII")  # sample_id, start, length, sample crc, record crc
_BODY = struct.Struct("<qqqI")
INDEX_BYTES = 1 << 30  # 32M records: more samples than one writer session ever stores
META_BYTES = 1 << 20  # a zarr.json or a repair note; each is a few KB
BLOSC_MAX_OVERHEAD = 16  # Blosc 1 stores data it cannot compress as is, behind its 16-byte header
_SEGMENT_FIX = "move that segment folder out of the store: `dspark store repair` then re-extracts the samples it held"


@dataclass(frozen=True)
class IndexEntry:
    segment: str
    start: int
    length: int
    crc: int


def _read_index(path: Path) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """CRC-valid records, and (byte offset, valid records after it) of each damaged one.

    Records are fixed-size, so a damaged record hides nothing: the scan goes on at
    the next record boundary. A partial record at the end (a writer killed
    mid-append) is a crash artefact and ignored silently; so are whole zero
    records at the end (a crash that grew the file before its data reached disk).
    """
    try:
        data = read_bounded(path, INDEX_BYTES)
    except FileNotFoundError:
        data = b""  # a segment whose writer has published nothing yet
    except FileRefused as e:
        raise StoreError(f"{path} {e}", _SEGMENT_FIX) from None
    end = len(data) - len(data) % INDEX_RECORD.size
    out, bad = [], []
    for off in range(0, end, INDEX_RECORD.size):
        sid, start, length, crc, rcrc = INDEX_RECORD.unpack_from(data, off)
        if zlib.crc32(data[off : off + _BODY.size]) != rcrc:
            bad.append(off)
            continue
        out.append((sid, start, length, crc))
    while bad and bad[-1] == end - INDEX_RECORD.size and not any(data[bad[-1] : end]):
        end = bad.pop()  # a zeroed tail
    # every record before `end` is either valid or damaged: count the valid ones after each damaged one
    return out, [(off, (end - off) // INDEX_RECORD.size - 1 - (len(bad) - k - 1)) for k, off in enumerate(bad)]


class _ChunkDamaged(Exception):
    """A chunk file that is missing, not a regular file, or not the size its header says (never handed to Blosc)."""


def _chunk_path(array_dir: Path, c: int, ndim: int, sep: str) -> Path:
    """The file of chunk `c` under zarr v3's default chunk key encoding with separator `sep`.

    dspark writes "." (c.7.0.0): every chunk of an array in its one folder, where "/" (c/7/0/0,
    stores written before) costs two mkdirs per chunk, ~0.4 ms each on this machine's disk.
    """
    keys = ["c", str(c), *("0",) * (ndim - 1)]
    return array_dir / ".".join(keys) if sep == "." else array_dir.joinpath(*keys)


# Our reader and writer threads are the parallelism; Blosc's global thread pool (used from the main
# thread otherwise) serializes every caller behind one lock.
numcodecs.blosc.use_threads = False


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
            raise StoreError(f"{path / 'zarr.json'} {e}", _SEGMENT_FIX) from None
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
        return _chunk_path(self.path, c, len(self.chunk_shape), self.sep)

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
                                 f"{shapes[name]}", _SEGMENT_FIX)
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
        seg_root = self.root / "segments"
        for seg in sorted(p.name for p in seg_root.iterdir()) if seg_root.exists() else []:
            records, damaged = _read_index(seg_root / seg / "index.bin")
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


@dataclass
class StoreCheck:
    """What `dspark store verify` found; `problems` is empty for a store that holds everything intact."""

    samples: int  # sample ids the store indexes
    damaged: dict[int, str]  # id -> what is wrong, for samples no copy of which reads back intact
    damaged_records: list[tuple[str, int, int]]  # (segment, byte offset, valid records after it) not yet repaired
    repaired_records: int  # damaged index records a `dspark store repair` made good
    missing: list[int] | None  # prepared ids the store lacks; None: not compared (no prepared data given)

    @property
    def problems(self) -> list[str]:
        out = []
        if self.damaged:
            out.append(f"{len(self.damaged)} of {self.samples} samples are damaged (first: {sorted(self.damaged)[:5]})")
        if self.missing:
            out.append(f"{len(self.missing)} prepared samples are missing (first: {self.missing[:5]})")
        if self.damaged_records and self.missing is None:
            out.append(f"{len(self.damaged_records)} damaged index records: the samples they held may be missing")
        return out


REPAIRS = "repairs"  # <store>/repairs/<stamp>.json: damaged index records a repair made good


def note_repair(root: str | Path, records: Iterable[tuple[str, int]], samples: Iterable[int]) -> None:
    """Record that every sample the damaged `records` held is stored again (written after the repair checked)."""
    folder = Path(root) / REPAIRS
    folder.mkdir(exist_ok=True)
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
    write_atomic(folder / name,
                 json.dumps({"damaged_index_records": [list(r[:2]) for r in records], "samples": sorted(samples)}))


def repaired_records(root: str | Path) -> set[tuple[str, int]]:
    """(segment, offset) of the damaged index records a repair noted as made good."""
    root, out = Path(root), set()
    for p in sorted((root / REPAIRS).glob("*.json")) if (root / REPAIRS).exists() else []:
        try:
            out.update((seg, off) for seg, off in json.loads(read_bounded(p, META_BYTES))["damaged_index_records"])
        except (OSError, FileRefused, ValueError, KeyError, TypeError):
            continue  # an unreadable note covers nothing: verify still reports those records
    return out


def check_store(store: ZarrStore, expected: int | None = None, ids: Iterable[int] | None = None,
                workers: int = 4, progress: bool = False) -> StoreCheck:
    """Read every sample (or `ids`) back against its checksum, list damaged index records, and,
    given the prepared data's sample count, the samples the store lacks."""
    from tqdm import tqdm

    ids = store.sample_ids if ids is None else [i for i in ids if i in store]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        reasons = list(tqdm(pool.map(store.damaged, ids), total=len(ids), desc="verify", unit="sample",
                            disable=not progress))
    noted = repaired_records(store.root)
    records = [r for r in store.damaged_records if r[:2] not in noted]
    missing = None if expected is None else [i for i in range(expected) if i not in store]
    return StoreCheck(len(store), {i: r for i, r in zip(ids, reasons) if r}, records,
                      len(store.damaged_records) - len(records), missing)


@dataclass
class _Pending:
    sample_id: int
    start: int
    length: int
    crc: int
    durable: Future  # resolves when the sample's index record is written


@dataclass
class _Buffer:
    hidden: np.ndarray
    tokens: np.ndarray
    scales: np.ndarray | None
    fill: int = 0
    pending: list[_Pending] = field(default_factory=list)

    @classmethod
    def empty(cls, like: _Buffer) -> _Buffer:
        return cls(np.empty_like(like.hidden), np.empty_like(like.tokens),
                   None if like.scales is None else np.empty_like(like.scales))


@dataclass
class _Chunk:
    """A chunk handed to the write pool, and the samples it completes (published once it and all before it are)."""

    written: Future
    completes: list[_Pending]


class ZarrSink(Sink):
    """Writer: appends samples to a fresh segment of its own.

    Full chunks are compressed and written by a small thread pool, so the caller
    (a verifier forward, a trainer's write-through) does not wait for Blosc, and
    two cores compress at once. Index records are still appended strictly in
    order: a sample is published (its record written, its future resolved) only
    when the chunk completing it and every chunk before it are on disk.
    `flush()` and `close()` wait for all of it.
    """

    name = "zarr"
    MAX_INFLIGHT = 4  # chunks queued or being written; more makes write() wait (bounded memory)

    def __init__(self, root: str | Path, manifest: StoreManifest, writer_id: str | None = None,
                 rewrite: Iterable[int] = (), write_threads: int = 2, accept_other_weights: bool = False):
        self.root = Path(root)
        self.manifest = manifest.create_or_match(self.root, accept_other_weights)
        self._weights_hash = manifest.verifier_weights_hash  # this writer's: its segment records it
        self.write_threads = write_threads  # 0: compress and write in the caller's thread
        self._known = set(ZarrStore(self.root).sample_ids) - set(rewrite)
        self._writer_id = writer_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._seg: Path | None = None
        self._pos = 0  # tokens handed to this segment
        self._buf: _Buffer | None = None
        self._index_fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: deque[_Chunk] = deque()
        self._error: StoreError | None = None  # a failed chunk write: every later write raises it
        self.samples_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()  # writer threads share one segment and its buffer
        self._publish_lock = threading.Lock()  # the in-flight queue and the index; never held while waiting

    def has(self, sample_id: int) -> bool:
        return sample_id in self._known

    def rewrite(self, sample_ids: Iterable[int]) -> None:
        """Accept these ids again although the store holds them: their stored copies are damaged.

        The new copy goes to this writer's segment; readers take the first copy that
        reads back valid, so the damaged one is never read again.
        """
        with self._lock:
            self._known.difference_update(sample_ids)

    def _open_segment(self) -> None:
        m = self.manifest
        C, L, H = m.chunk_tokens, len(m.captured_layer_ids), m.hidden_size
        self._seg = self.root / "segments" / self._writer_id
        group = zarr.open_group(self._seg, mode="w-")
        store_dtype = stored_numpy_dtype(m.encoding, m.dtype)
        blosc = BloscCodec(cname=m.codec.cname, clevel=m.codec.clevel, shuffle=m.codec.shuffle,
                           typesize=store_dtype.itemsize, blocksize=m.codec.blocksize)
        small = BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=4)
        cfg = {"write_empty_chunks": True}  # dense data: skip the per-chunk emptiness scan
        specs = {"hidden": ((CAPACITY, L, H), (C, L, H), store_dtype, blosc),
                 "token_ids": ((CAPACITY,), (C,), np.int32, small)}
        if m.encoding == "fp8_e4m3":
            specs["scales"] = ((CAPACITY, L), (C, L), np.float32, small)
        attrs = {"logical_dtype": m.dtype, "encoding": m.encoding, "layer_ids": m.captured_layer_ids,
                 "verifier_weights_hash": self._weights_hash}
        for name, (shape, chunks, dtype, codec) in specs.items():  # zarr writes the metadata, we the chunks
            group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=[codec], fill_value=0,
                               config=cfg, attributes=attrs if name == "hidden" else None,
                               chunk_key_encoding={"name": "default", "separator": "."})
        self._encoders = {name: (self._seg / name, len(shape), Blosc(cname=codec.cname.value, clevel=codec.clevel,
                                                                     shuffle=_SHUFFLE[codec.shuffle.value],
                                                                     blocksize=codec.blocksize))
                          for name, (shape, _, _, codec) in specs.items()}
        scales = np.zeros((C, L), np.float32) if "scales" in specs else None
        self._buf = _Buffer(np.zeros((C, L, H), store_dtype), np.zeros(C, np.int32), scales)
        self._index_fd = os.open(self._seg / "index.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pool = (ThreadPoolExecutor(self.write_threads, thread_name_prefix="dspark-zarr-write")
                      if self.write_threads else None)

    def write(self, sample: Sample) -> Future:
        if sample.sample_id in self._known:  # readers take the first valid record: never store it twice
            return done()
        m = self.manifest
        want = (len(m.captured_layer_ids), m.hidden_size)
        if tuple(sample.hidden_states.shape[1:]) != want:
            raise StoreError(f"sample {sample.sample_id} has hidden states {tuple(sample.hidden_states.shape)}, "
                             f"store {self.root} holds [T, {want[0]}, {want[1]}]",
                             "extract with the store's layer ids and verifier")
        payload, scales = encode(sample.hidden_states, m.encoding)
        tokens = np.asarray(sample.token_ids, dtype=np.int64)
        crc = sample_checksum(m.checksum, tokens, payload, scales)
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._append(sample.sample_id, tokens, payload, scales, crc)

    def _append(self, sample_id: int, tokens: np.ndarray, payload: np.ndarray, scales: np.ndarray | None,
                crc: int) -> Future:
        if self._seg is None:
            self._open_segment()
        T, C = len(tokens), self.manifest.chunk_tokens
        durable: Future = Future()
        self._buf.pending.append(_Pending(sample_id, self._pos, T, crc, durable))
        done = 0
        while done < T:
            buf = self._buf
            n = min(T - done, C - buf.fill)
            buf.hidden[buf.fill : buf.fill + n] = payload[done : done + n]
            buf.tokens[buf.fill : buf.fill + n] = tokens[done : done + n]
            if buf.scales is not None:
                buf.scales[buf.fill : buf.fill + n] = scales[done : done + n]
            buf.fill += n
            done += n
            self._pos += n
            if buf.fill == C:
                self._flush_chunk()
        self.bytes_written += payload.nbytes
        return durable

    def _flush_chunk(self) -> None:
        """Hand the buffered (possibly partial) chunk to the write pool, with the samples it completes."""
        buf = self._buf
        if buf.fill == 0:
            return
        for a in (buf.hidden, buf.tokens, buf.scales):  # a partial chunk is stored full size, zero-padded
            if a is not None:
                a[buf.fill :] = 0
        c = (self._pos - buf.fill) // self.manifest.chunk_tokens  # chunks start aligned: see flush()
        completes = [p for p in buf.pending if p.start + p.length <= self._pos]
        self._buf = _Buffer.empty(buf)
        self._buf.pending = [p for p in buf.pending if p.start + p.length > self._pos]
        while len(self._inflight) >= self.MAX_INFLIGHT:  # bounded memory: wait for the oldest chunk
            wait([self._inflight[0].written])
            self._retire()
        if self._pool is None:  # write_threads=0: in the caller's thread
            written = Future()
            try:
                self._write_chunks(c, buf)
                written.set_result(None)
            except Exception as e:
                written.set_exception(e)
        else:
            written = self._pool.submit(self._write_chunks, c, buf)
        with self._publish_lock:
            self._inflight.append(_Chunk(written, completes))
        written.add_done_callback(self._retire)
        if self._error is not None:
            raise self._error

    def _write_chunks(self, c: int, buf: _Buffer) -> None:
        self._write_chunk("token_ids", c, buf.tokens)
        if buf.scales is not None:
            self._write_chunk("scales", c, buf.scales)
        self._write_chunk("hidden", c, buf.hidden)

    def _write_chunk(self, name: str, c: int, data: np.ndarray) -> None:
        """Compress one chunk and write it as zarr would: a temp file renamed into place.

        Straight to Blosc, not through zarr's codec pipeline (several times its cost),
        in the format zarr's BloscCodec writes for this array (the array's metadata
        names that codec: stock zarr-python reads it).
        """
        array_dir, ndim, codec = self._encoders[name]
        # Not fsynced (durable=False): at extraction rates an fsync per chunk would cap the writer, and a
        # chunk a power cut loses is caught by its length or the sample checksum, then `store repair`ed.
        with replacing(_chunk_path(array_dir, c, ndim, "."), durable=False) as f:
            f.write(codec.encode(data))

    def _retire(self, _: Future | None = None) -> None:
        """Publish, in order, the samples of every chunk written so far; fail them all after a failed write."""
        with self._publish_lock:
            while self._inflight and self._inflight[0].written.done():
                chunk = self._inflight.popleft()
                e = chunk.written.exception()
                if e is not None and self._error is None:
                    self._error = StoreError(
                        f"writing to store {self.root} failed ({getattr(e, 'strerror', None) or e}); samples "
                        "already indexed are intact", "free disk space (or fix the folder) and rerun: "
                        "extraction resumes where it stopped")
                for p in chunk.completes:
                    if self._error is None:
                        self._publish(p)
                    else:  # nobody waits forever on a write that cannot happen
                        p.durable.set_exception(self._error)

    def _publish(self, p: _Pending) -> None:
        body = _BODY.pack(p.sample_id, p.start, p.length, p.crc)
        os.write(self._index_fd, body + struct.pack("<I", zlib.crc32(body)))
        self._known.add(p.sample_id)
        self.samples_written += 1
        p.durable.set_result(None)

    def _drain(self) -> None:
        """Wait until every chunk handed to the pool is written and its samples published (or failed)."""
        with self._publish_lock:
            pending = [chunk.written for chunk in self._inflight]
        wait(pending)
        self._retire()  # done callbacks may still be running: publish here rather than race them
        if self._error is not None:
            for p in self._buf.pending:
                if not p.durable.done():
                    p.durable.set_exception(self._error)
            raise self._error

    def flush(self) -> None:
        """Make every sample written so far visible now (write-through caches need this).

        The partial chunk is written and the next sample starts on a fresh chunk,
        so chunks stay write-once at the cost of some padding.
        """
        with self._lock:
            if self._seg is None:
                return
            if self._buf.fill:
                self._flush_chunk()
                C = self.manifest.chunk_tokens
                self._pos = -(-self._pos // C) * C
            self._drain()

    def close(self) -> None:
        with self._lock:
            if self._seg is None:
                return
            try:
                if self._error is None:
                    self._flush_chunk()
            finally:
                try:
                    self._drain()
                finally:
                    if self._pool is not None:
                        self._pool.shutdown(wait=True)
                    os.close(self._index_fd)
                    self._seg = None


@register_sink("zarr")
def _make_zarr_sink(*, store: str | Path | None, manifest: StoreManifest, rewrite: Iterable[int] = (),
                    accept_other_weights: bool = False, **_) -> ZarrSink:
    if store is None:
        raise InputError("writing to zarr needs a store folder", "pass --store PATH")
    return ZarrSink(store, manifest, rewrite=rewrite, accept_other_weights=accept_other_weights)


@register_source("zarr")
def _open_zarr_source(*, store: str | Path, **_) -> ZarrStore:
    return ZarrStore(store)
