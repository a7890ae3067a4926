"""A chunked, compressed Zarr store of per-sample hidden states.

Layout (one store = one verifier, one layer set, one prepared data set):

    manifest.json                    StoreManifest, written once, exclusively
    segments/<writer>/               one zarr v3 group per writer session
        hidden     [CAP, L+1, H]     uint16 bits of bf16 (or uint8 fp8), token-major
        scales     [CAP, L+1]        float32, fp8 only
        token_ids  [CAP]             int32
        index.bin                    32-byte records: sample_id, start, length, crc, record crc

Why it is safe without locks:
- Each writer session owns a fresh segment, so no chunk is ever shared or
  rewritten: full chunks are written once, the last partial chunk at close.
  Zarr's local store writes each chunk through a temp file and a rename.
- Arrays are created with a fixed huge capacity; nothing resizes, so array
  metadata is never rewritten after creation.
- A sample's index record is appended only after every chunk holding its
  tokens is written. Readers ignore torn or corrupt trailing records, so a
  sample is visible completely or not at all, whenever the writer dies.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from dspark.connector.base import Sample, Sink, Source, done, register_sink, register_source
from dspark.connector.encoding import bytes_per_token, decode, encode, sample_crc, stored_numpy_dtype
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest
from dspark.errors import InputError, StoreError

CAPACITY = 1 << 40  # tokens per segment; chunks are sparse, so this costs nothing
_RECORD = struct.Struct("<qqqII")  # sample_id, start, length, sample crc, record crc
_BODY = struct.Struct("<qqqI")


@dataclass(frozen=True)
class IndexEntry:
    segment: str
    start: int
    length: int
    crc: int


def _read_index(path: Path) -> list[tuple[int, int, int, int]]:
    """Complete, CRC-valid records; a torn or damaged tail is ignored."""
    data = path.read_bytes() if path.exists() else b""
    out = []
    for off in range(0, len(data) - len(data) % _RECORD.size, _RECORD.size):
        sid, start, length, crc, rcrc = _RECORD.unpack_from(data, off)
        if zlib.crc32(data[off : off + _BODY.size]) != rcrc:
            break  # a record is appended only after its predecessors: nothing valid follows
        out.append((sid, start, length, crc))
    return out


class _Segment:
    """Open arrays of one segment (read side), with a small LRU of decoded chunks.

    Samples are much shorter than a chunk on small models and span chunk
    boundaries on big ones; the cache makes sequential reads decode each chunk
    once instead of once per sample.
    """

    CACHE_CHUNKS = 8

    def __init__(self, path: Path, fp8: bool):
        self.path = path
        self.arrays = {name: zarr.open_array(path / name, mode="r")
                       for name in ("hidden", "token_ids", *(("scales",) if fp8 else ()))}
        self.chunk_tokens = self.arrays["hidden"].chunks[0]
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def _chunk(self, name: str, c: int) -> np.ndarray:
        key = (name, c)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        block = self.arrays[name].get_block_selection((c,) + (0,) * (self.arrays[name].ndim - 1))
        with self._lock:
            self._cache[key] = block
            while len(self._cache) > self.CACHE_CHUNKS * len(self.arrays):
                self._cache.popitem(last=False)
        return block

    def read(self, name: str, start: int, length: int) -> np.ndarray | None:
        if name not in self.arrays:
            return None
        C = self.chunk_tokens
        c0, c1 = start // C, (start + length - 1) // C
        blocks = [self._chunk(name, c) for c in range(c0, c1 + 1)]
        joined = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return joined[start - c0 * C : start - c0 * C + length]


class ZarrStore(Source):
    """Reader: random access by sample id and a sequential iterator with read-ahead."""

    live = False

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.location = str(self.root)
        self.manifest = StoreManifest.load(self.root)
        self._fp8 = self.manifest.encoding == "fp8_e4m3"
        self._segments: dict[str, _Segment] = {}
        self.duplicates = 0
        self.refresh()

    def refresh(self) -> None:
        """Re-read the segment indexes (picks up samples written since opening)."""
        index: dict[int, IndexEntry] = {}
        self.duplicates = 0
        seg_root = self.root / "segments"
        for seg in sorted(p.name for p in seg_root.iterdir()) if seg_root.exists() else []:
            for sid, start, length, crc in _read_index(seg_root / seg / "index.bin"):
                if sid in index:
                    self.duplicates += 1  # concurrent writers may both write a sample: first wins
                    continue
                index[sid] = IndexEntry(seg, start, length, crc)
        self._index = index

    @property
    def sample_ids(self) -> list[int]:
        return sorted(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._index

    def entry(self, sample_id: int) -> IndexEntry:
        try:
            return self._index[sample_id]
        except KeyError:
            raise StoreError(f"sample {sample_id} is not in store {self.root}",
                             "extract it first (`dspark extract` resumes and fills gaps)") from None

    def _segment(self, name: str) -> _Segment:
        if name not in self._segments:
            self._segments[name] = _Segment(self.root / "segments" / name, self._fp8)
        return self._segments[name]

    def _read_raw(self, sample_id: int):
        e = self.entry(sample_id)
        seg = self._segment(e.segment)
        tokens = seg.read("token_ids", e.start, e.length).astype(np.int64)
        return e, tokens, seg.read("hidden", e.start, e.length), seg.read("scales", e.start, e.length)

    def read(self, sample_id: int, check: bool = False) -> Sample:
        e, tokens, payload, scales = self._read_raw(sample_id)
        if check and sample_crc(tokens, payload, scales) != e.crc:
            raise StoreError(f"sample {sample_id} in {self.root} fails its checksum",
                             "run `dspark store verify`, then re-extract the damaged samples")
        m = self.manifest
        return Sample(sample_id, tokens, decode(payload, scales, m.encoding, m.dtype))

    def iter_samples(self, ids: Iterable[int] | None = None, read_ahead: int = 4,
                     check: bool = False) -> Iterator[Sample]:
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
            e, tokens, payload, scales = self._read_raw(sample_id)
        except Exception as exc:  # a missing/undecodable chunk is damage, whatever zarr raises
            return f"unreadable ({type(exc).__name__}: {exc})"
        if sample_crc(tokens, payload, scales) != e.crc:
            return "checksum mismatch"
        return None

    def fingerprint(self) -> str:
        """Identity of the content: manifest identity plus every sample's id, length and checksum."""
        h = hashlib.sha256(self.manifest.model_dump_json(include=set(IDENTITY_FIELDS)).encode())
        for sid in self.sample_ids:
            e = self._index[sid]
            h.update(struct.pack("<qqI", sid, e.length, e.crc))
        return h.hexdigest()

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def info(self) -> dict:
        m = self.manifest
        tokens = sum(e.length for e in self._index.values())
        raw = tokens * bytes_per_token(len(m.captured_layer_ids), m.hidden_size, "raw", m.dtype)
        disk = self.disk_bytes()
        return {"store": str(self.root), "samples": len(self), "tokens": tokens,
                "segments": len(list((self.root / "segments").glob("*"))) if (self.root / "segments").exists() else 0,
                "duplicate_records": self.duplicates, "raw_bytes": raw, "disk_bytes": disk,
                "ratio": round(raw / disk, 3) if disk else None, "manifest": m.model_dump()}


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


class ZarrSink(Sink):
    """Writer: appends samples to a fresh segment of its own.

    A sample becomes durable when the chunk completing it is written and its index
    record appended; `flush()` forces that for a partial chunk.
    """

    name = "zarr"

    def __init__(self, root: str | Path, manifest: StoreManifest, writer_id: str | None = None):
        self.root = Path(root)
        self.manifest = manifest.create_or_match(self.root)
        self._known = set(ZarrStore(self.root).sample_ids)
        self._writer_id = writer_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._seg: Path | None = None
        self._pos = 0  # tokens handed to this segment
        self._buf: _Buffer | None = None
        self._index_fd: int | None = None
        self.samples_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()  # writer-pool threads share one segment and its buffer

    def has(self, sample_id: int) -> bool:
        return sample_id in self._known

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
        attrs = {"logical_dtype": m.dtype, "encoding": m.encoding, "layer_ids": m.captured_layer_ids}
        self._arrays = {
            name: group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=[codec],
                                     fill_value=0, config=cfg, attributes=attrs if name == "hidden" else None)
            for name, (shape, chunks, dtype, codec) in specs.items()}
        scales = np.zeros((C, L), np.float32) if "scales" in specs else None
        self._buf = _Buffer(np.zeros((C, L, H), store_dtype), np.zeros(C, np.int32), scales)
        self._index_fd = os.open(self._seg / "index.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, sample: Sample) -> Future:
        if sample.sample_id in self._known:  # the first record wins anyway: never store it twice
            return done()
        m = self.manifest
        want = (len(m.captured_layer_ids), m.hidden_size)
        if tuple(sample.hidden_states.shape[1:]) != want:
            raise StoreError(f"sample {sample.sample_id} has hidden states {tuple(sample.hidden_states.shape)}, "
                             f"store {self.root} holds [T, {want[0]}, {want[1]}]",
                             "extract with the store's layer ids and verifier")
        payload, scales = encode(sample.hidden_states, m.encoding)
        tokens = np.asarray(sample.token_ids, dtype=np.int64)
        crc = sample_crc(tokens, payload, scales)
        with self._lock:
            return self._append(sample.sample_id, tokens, payload, scales, crc)

    def _append(self, sample_id: int, tokens: np.ndarray, payload: np.ndarray, scales: np.ndarray | None,
                crc: int) -> Future:
        if self._seg is None:
            self._open_segment()
        buf = self._buf
        T, C = len(tokens), self.manifest.chunk_tokens
        durable: Future = Future()
        buf.pending.append(_Pending(sample_id, self._pos, T, crc, durable))
        done = 0
        while done < T:
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
        """Write the buffered (possibly partial) chunk, then publish the samples it completes."""
        buf = self._buf
        if buf.fill == 0:
            return
        start = self._pos - buf.fill
        sl = slice(start, self._pos)
        try:
            self._arrays["token_ids"][sl] = buf.tokens[: buf.fill]
            if buf.scales is not None:
                self._arrays["scales"][sl] = buf.scales[: buf.fill]
            self._arrays["hidden"][sl] = buf.hidden[: buf.fill]
        except OSError as e:
            err = StoreError(f"writing to store {self.root} failed ({e.strerror or e}); samples "
                             f"already indexed are intact", "free disk space (or fix the folder) and rerun: "
                             "extraction resumes where it stopped")
            for p in buf.pending:  # nobody waits forever on a write that cannot happen
                p.durable.set_exception(err)
            buf.pending = []
            raise err from e
        buf.fill = 0
        still = []
        for p in buf.pending:
            if p.start + p.length <= self._pos:
                self._publish(p)
            else:
                still.append(p)
        buf.pending = still

    def _publish(self, p: _Pending) -> None:
        body = _BODY.pack(p.sample_id, p.start, p.length, p.crc)
        os.write(self._index_fd, body + struct.pack("<I", zlib.crc32(body)))
        self._known.add(p.sample_id)
        self.samples_written += 1
        p.durable.set_result(None)

    def flush(self) -> None:
        """Make every sample written so far visible now (write-through caches need this).

        The partial chunk is written and the next sample starts on a fresh chunk,
        so chunks stay write-once at the cost of some padding.
        """
        with self._lock:
            if self._seg is None or self._buf.fill == 0:
                return
            self._flush_chunk()
            C = self.manifest.chunk_tokens
            self._pos = -(-self._pos // C) * C

    def close(self) -> None:
        with self._lock:
            if self._seg is None:
                return
            self._flush_chunk()
            os.close(self._index_fd)
            self._seg = None


@register_sink("zarr")
def _make_zarr_sink(*, store: str | Path | None, manifest: StoreManifest, **_) -> ZarrSink:
    if store is None:
        raise InputError("writing to zarr needs a store folder", "pass --store PATH")
    return ZarrSink(store, manifest)


@register_source("zarr")
def _open_zarr_source(*, store: str | Path, **_) -> ZarrStore:
    return ZarrStore(store)
