"""Writing a Zarr store: each writer session appends samples to a fresh segment of its own.

Chunks are compressed off the caller's thread and written once; a sample's index record is
appended only after every chunk holding it is on disk (format.py says why this needs no locks).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec

from dspark.connector.base import Sample, Sink, done
from dspark.connector.checksum import sample_checksum
from dspark.connector.config import ZarrConfig
from dspark.connector.encoding import encode, stored_numpy_dtype, torch_dtype
from dspark.connector.manifest import StoreManifest
from dspark.connector.zarr.format import CAPACITY, chunk_path, index_record, segment_indexes
from dspark.core.errors import InputError, StoreError
from dspark.core.fsio import replacing

_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


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
                 rewrite: Iterable[int] = (), write_threads: int = 2, accept_other_weights: bool = False,
                 segment_attrs: dict[str, str] | None = None):
        self.root = Path(root)
        self.manifest = manifest.create_or_match(self.root, accept_other_weights)
        self._weights_hash = manifest.verifier_weights_hash  # this writer's: its segment records it
        self._segment_attrs = dict(segment_attrs or {})  # e.g. the vLLM runner that extracted: the segment records it
        self.write_threads = write_threads  # 0: compress and write in the caller's thread
        # the ids its index records name, read without a reader (which would load the manifest again)
        self._known = {r[0] for _, records, _ in segment_indexes(self.root) for r in records} - set(rewrite)
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
                 "verifier_weights_hash": self._weights_hash, **self._segment_attrs}
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
        if sample.hidden_states.dtype != torch_dtype(m.dtype):  # its bits would be stored as the store's dtype's
            raise StoreError(f"sample {sample.sample_id} has {sample.hidden_states.dtype} hidden states, store "
                             f"{self.root} holds {m.dtype}", f"cast them to {m.dtype}, or write them to a new store")
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
        with replacing(chunk_path(array_dir, c, ndim, "."), durable=False) as f:
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
        os.write(self._index_fd, index_record(p.sample_id, p.start, p.length, p.crc))
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


def open_sink(*, manifest: StoreManifest, zarr: ZarrConfig | None = None, **_) -> ZarrSink:
    """The SINKS factory (registry.py): a writer session into the store `zarr.store` names."""
    cfg = zarr or ZarrConfig()
    if cfg.store is None:
        raise InputError("writing to zarr needs a store folder", "pass --store PATH")
    return ZarrSink(cfg.store, manifest, rewrite=cfg.rewrite, accept_other_weights=cfg.accept_other_weights,
                    segment_attrs=cfg.segment_attrs)
