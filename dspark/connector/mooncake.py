"""Mooncake sink and reader: one packed object per sample, live between machines.

Object layout is hs_connectors' transfer format (64-byte-aligned `hidden_states
[T, L+1, H]` then `token_ids [T]`), so either side interoperates with it. The
transfer manifest (layout, sample id, xxh3 checksum, store identity) travels beside the
object: in the HTTP reply of `dspark serve`, and as a small `<key>:manifest`
object written *before* the data, so a producer-driven consumer finds it too.

Visibility: a Mooncake put is atomic, so the data key's presence means the
sample is complete. A producer failure publishes `<key>:error`, which readers
check first and raise at once instead of waiting for a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from math import prod

import numpy as np
import torch
import xxhash  # ~10x faster than zlib.crc32: the checksum must not be the live path's bottleneck

from dspark.config import MooncakeConfig
from dspark.connector.base import Sample, Sink, register_sink
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest
from dspark.errors import DsparkError
from dspark.fingerprint import sha256_json

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ INFO chatter; our errors say what matters

TRANSFER_VERSION = 1  # hs_connectors' transfer-manifest version
ALIGN = 64
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200  # the store is out of space
GIB = 1 << 30
log = logging.getLogger("dspark.mooncake")


class MooncakeError(DsparkError):
    """Anything the live store did wrong."""


class MooncakeUnavailable(MooncakeError):
    """The master cannot be reached (down, wrong address, network)."""


class MooncakeFull(MooncakeError):
    """No space left in the mounted segments."""


class ObjectGone(MooncakeError):
    """An object that existed is no longer there (lease expired and evicted, or its segment left)."""


class CorruptObject(MooncakeError):
    """An object whose size, layout or checksum does not match its manifest."""


class ProducerFailed(MooncakeError):
    """The producer published an error marker for this sample."""


def master_binary() -> str:
    """`mooncake_master` as shipped in the wheel, also when the venv's bin/ is not on PATH."""
    import shutil
    import sys
    from pathlib import Path

    for candidate in (shutil.which("mooncake_master"), Path(sys.executable).parent / "mooncake_master"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise MooncakeError("mooncake_master is not installed", "pip install 'dspark[mooncake]'")


def _check_reachable(master: str) -> None:
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=2).close()
    except (OSError, ValueError) as e:
        raise MooncakeUnavailable(
            f"cannot reach the Mooncake master at {master} ({e})",
            "start it (mooncake_master --rpc_port 50051 ...) or fix --mooncake-master") from None


def connect(cfg: MooncakeConfig):
    """A set-up MooncakeDistributedStore client; fails fast and clearly when the master is away."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError:
        raise MooncakeError("the Mooncake client is not installed",
                            "pip install 'dspark[mooncake]' (mooncake-transfer-engine-non-cuda on CPU machines)") from None
    _check_reachable(cfg.master)  # setup() itself retries for ~90 s against a dead address
    store = MooncakeDistributedStore()
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, int(cfg.global_segment_gib * GIB),
                     int(cfg.local_buffer_gib * GIB), cfg.protocol, cfg.device, cfg.master)
    if rc != 0:
        raise MooncakeUnavailable(f"Mooncake setup against {cfg.master} failed (status {rc})",
                                  "check --mooncake-protocol/--mooncake-device and that the master is healthy")
    return store


def namespace(manifest: StoreManifest) -> str:
    """Keys are scoped by store identity, so two verifiers or layer sets never collide."""
    return sha256_json(manifest.model_dump(include=set(IDENTITY_FIELDS)))[:16]


def sample_key(manifest: StoreManifest, sample_id: int) -> str:
    return f"dspark/{namespace(manifest)}/{sample_id}"


def object_key(manifest: StoreManifest, sample: Sample) -> str:
    """Where a sample lives: the handle its request was given, else the key of its sample id."""
    return sample.handle or sample_key(manifest, sample.sample_id)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(num_tokens: int, manifest: StoreManifest) -> tuple[dict, int]:
    """hs_connectors' packed layout: tensor name -> shape, dtype, offset, nbytes."""
    tensors, offset = {}, 0
    for name, shape, dtype in (
            ("hidden_states", [num_tokens, len(manifest.captured_layer_ids), manifest.hidden_size], manifest.dtype),
            ("token_ids", [num_tokens], "int64")):
        nbytes = prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        tensors[name] = {"shape": shape, "dtype": f"torch.{dtype}", "nbytes": nbytes, "offset": offset}
        offset = _align(offset + nbytes)
    return tensors, offset


def transfer_params(manifest: StoreManifest, key: str, sample_id: int | None, num_tokens: int) -> dict:
    """What an extractor answers in `kv_transfer_params`: all of it known before the states exist.

    vLLM's scheduler side (our KV connector) and `dspark serve` both return exactly
    this, so a trainer cannot tell which engine answered. The checksum is known only
    after the forward: it travels in the `<key>:manifest` object.
    """
    tensors, total = layout(num_tokens, manifest)
    return {"handle": key, "version": TRANSFER_VERSION, "tensors": tensors,
            "metadata": {"num_tokens": num_tokens, "total_aligned_bytes": total, "extract_mode": "prompt_only",
                         "sample_id": None if sample_id is None else int(sample_id), "namespace": namespace(manifest)}}


def pack(sample: Sample, manifest: StoreManifest, key: str, out: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Lay the sample out in `out` (e.g. a registered staging buffer; new memory if None)."""
    T = len(sample.token_ids)
    transfer = transfer_params(manifest, key, sample.sample_id, T)
    tensors, total = transfer["tensors"], transfer["metadata"]["total_aligned_bytes"]
    buf = np.zeros(total, dtype=np.uint8) if out is None else out[:total]
    hidden = sample.hidden_states.detach().cpu().contiguous()
    for name, raw in (("hidden_states", hidden.view(torch.uint8).reshape(-1).numpy()),
                      ("token_ids", np.ascontiguousarray(sample.token_ids, dtype=np.int64).view(np.uint8))):
        spec = tensors[name]
        if raw.nbytes != spec["nbytes"]:
            raise CorruptObject(f"sample {sample.sample_id}: {name} has {raw.nbytes} bytes, layout says {spec['nbytes']}",
                                "extract with the store's verifier and layer ids")
        buf[spec["offset"] : spec["offset"] + spec["nbytes"]] = raw
        buf[spec["offset"] + spec["nbytes"] : _align(spec["offset"] + spec["nbytes"])] = 0  # padding, deterministic
    transfer["metadata"]["xxh3_64"] = xxhash.xxh3_64_intdigest(buf.data)
    return buf, transfer


def unpack(buf: np.ndarray, transfer: dict, manifest: StoreManifest) -> Sample:
    """Validate an object against its transfer manifest and the store identity, then decode it."""
    meta, key = transfer.get("metadata", {}), transfer.get("handle")
    if transfer.get("version") != TRANSFER_VERSION or meta.get("namespace") != namespace(manifest):
        raise CorruptObject(f"object {key} was written for another store (version/namespace differ)",
                            "point producer and consumer at the same verifier, layers and data")
    if len(buf) != meta.get("total_aligned_bytes"):
        raise CorruptObject(f"object {key} has {len(buf)} bytes, its manifest says {meta.get('total_aligned_bytes')}",
                            "the object is truncated or not ours; it is rejected and can be regenerated")
    expected, _ = layout(meta["num_tokens"], manifest)
    if transfer["tensors"] != expected:
        raise CorruptObject(f"object {key} layout {transfer['tensors']} does not match the store's {expected}",
                            "producer and consumer disagree on layers, hidden size or dtype")
    if xxhash.xxh3_64_intdigest(buf.data) != meta.get("xxh3_64"):
        raise CorruptObject(f"object {key} fails its checksum", "it is rejected and can be regenerated")
    h, t = expected["hidden_states"], expected["token_ids"]
    hidden = torch.from_numpy(buf[h["offset"] : h["offset"] + h["nbytes"]].copy()).view(
        getattr(torch, manifest.dtype)).view(*h["shape"])
    tokens = buf[t["offset"] : t["offset"] + t["nbytes"]].view(np.int64).copy()
    return Sample(-1 if meta["sample_id"] is None else int(meta["sample_id"]), tokens, hidden, handle=key)


class MooncakeStore:
    """Thin, error-translating wrapper over one Mooncake client, shared by sink and reader."""

    STAGING_GRANULE = 16 << 20

    def __init__(self, manifest: StoreManifest, config: MooncakeConfig):
        self.manifest, self.config = manifest, config
        self.client = connect(config)
        self._staging: dict[tuple[int, str], np.ndarray] = {}

    def staging(self, role: str, nbytes: int) -> np.ndarray:
        """This thread's registered buffer for `role`: put_from/get_into move bytes without extra copies."""
        slot = (threading.get_ident(), role)
        buf = self._staging.get(slot)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                self.client.unregister_buffer(buf.ctypes.data)
            cap = -(-max(nbytes, 1) // self.STAGING_GRANULE) * self.STAGING_GRANULE
            buf = np.empty(cap, dtype=np.uint8)
            self._status("register_buffer", role, self.client.register_buffer(buf.ctypes.data, cap))
            self._staging[slot] = buf
        return buf

    def put_from(self, key: str, buf: np.ndarray) -> None:
        """Upsert a view of a staging buffer (zero-copy)."""
        self._status("put", key, self.client.upsert_from(key, buf.ctypes.data, buf.nbytes))

    def get_into(self, key: str, size: int) -> np.ndarray:
        """Read a `size`-byte object into this thread's staging buffer; the view is valid until the next read."""
        buf = self.staging("get", size)
        got = self.client.get_into(key, buf.ctypes.data, size)
        if isinstance(got, int) and got < 0:
            self._status("get", key, got)
        if got != size:
            raise CorruptObject(f"object {key} has {got} bytes, its manifest says {size}",
                                "the object is truncated or not ours; it is rejected and can be regenerated")
        return buf[:size]

    def _status(self, op: str, key: str, rc) -> None:
        if isinstance(rc, int) and rc < 0:
            if rc == OBJECT_NOT_FOUND:
                raise ObjectGone(f"Mooncake object {key} vanished before it was read: its lease expired and it was "
                                 "evicted, or the client whose segment held it exited",
                                 "it is regenerated on the next request; keep producers (or a memory-mounting "
                                 "consumer) alive, and raise --mooncake-global-segment-gib if the store fills")
            if rc == NO_AVAILABLE_HANDLE:
                raise MooncakeFull(f"the Mooncake store is out of space ({op} {key})",
                                   "raise --mooncake-global-segment-gib, or consume with --on-generate delete")
            raise MooncakeUnavailable(f"Mooncake {op} {key} failed (status {rc}): the master may be down",
                                      f"check the master at {self.config.master}")

    def exists(self, *keys: str) -> list[bool]:
        """One round trip for several keys."""
        rcs = self.client.batch_is_exist(list(keys))
        for k, rc in zip(keys, rcs):
            self._status("is_exist", k, rc)
        return [rc == 1 for rc in rcs]

    def put(self, key: str, data) -> None:
        """Upsert: a regenerated sample replaces a stale object (a plain put keeps the first)."""
        self._status("put", key, self.client.upsert(key, data if isinstance(data, bytes) else data.tobytes()))

    def get(self, key: str, size: int | None = None) -> np.ndarray:
        """The object's bytes; with `size` known (from a manifest) this is one round trip."""
        if size is None:
            size = self.client.get_size(key)
            self._status("get_size", key, size)
        data = self.client.get(key)
        if not data:
            self._status("get", key, OBJECT_NOT_FOUND)
        if len(data) != size:
            raise CorruptObject(f"object {key} has {len(data)} bytes, its manifest says {size}",
                                "the object is truncated or not ours; it is rejected and can be regenerated")
        return np.frombuffer(data, dtype=np.uint8)

    def remove(self, *keys: str) -> None:
        """Remove these exact keys in one round trip; a missing one is fine."""
        for k, rc in zip(keys, self.client.batch_remove(list(keys), True)):
            if rc != OBJECT_NOT_FOUND:
                self._status("remove", k, rc)


class MooncakeSink(Sink):
    """Publishes samples live, with back-pressure: it never lets unconsumed bytes
    exceed 80% of the segment it mounts, so Mooncake never has to evict a sample
    nobody has read yet, and a put refused for space is retried while consumers
    free it (up to put_timeout). Puts run on --mooncake-writer-threads threads,
    overlapping the next forward; a sample is durable once its put returned."""

    name = "mooncake"

    def __init__(self, manifest: StoreManifest, config: MooncakeConfig):
        self.manifest = manifest
        self.store = MooncakeStore(manifest, config)
        self.config = config
        self._outstanding: deque[tuple[str, int]] = deque()
        self._outstanding_bytes = 0
        self._lock = threading.Lock()  # serialises puts: one staging buffer, one outstanding-bytes budget
        self._pending_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, config.writer_threads), thread_name_prefix="mooncake-put")
        self._pending: list[Future] = []
        self.samples_written = self.bytes_written = 0

    def has(self, sample_id: int) -> bool:
        return self.store.exists(sample_key(self.manifest, sample_id))[0]

    def _wait_for_room(self, nbytes: int) -> None:
        if self.config.global_segment_gib <= 0:
            return  # others' memory: a full store answers NO_AVAILABLE_HANDLE, which write() waits out
        budget = 0.8 * self.config.global_segment_gib * GIB
        deadline = time.monotonic() + self.config.put_timeout
        while self._outstanding and self._outstanding_bytes + nbytes > budget:
            key, size = self._outstanding[0]
            if not self.store.exists(key)[0]:  # consumed (deleted) by the trainer
                self._outstanding.popleft()
                self._outstanding_bytes -= size
                continue
            if time.monotonic() > deadline:
                raise MooncakeFull(f"no consumer freed space for {self.config.put_timeout:.0f}s "
                                   f"({self._outstanding_bytes / 1e6:.1f} MB unconsumed)",
                                   "run the trainer with --on-generate delete, or raise --mooncake-global-segment-gib")
            time.sleep(0.05)

    def put(self, sample: Sample) -> dict:
        """Publish one sample now; returns its full transfer manifest (with the checksum)."""
        key = object_key(self.manifest, sample)
        with self._lock:
            _, total = layout(len(sample.token_ids), self.manifest)
            buf, transfer = pack(sample, self.manifest, key, self.store.staging("put", total))
            self._wait_for_room(buf.nbytes)
            deadline = time.monotonic() + self.config.put_timeout
            self.store.remove(key + ":error")  # a stale failure must not shadow this sample
            self.store.put(key + ":manifest", json.dumps(transfer).encode())
            while True:
                try:
                    self.store.put_from(key, buf)
                    break
                except MooncakeFull:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # space frees as consumers delete
            self._outstanding.append((key, buf.nbytes))
            self._outstanding_bytes += buf.nbytes
        self.samples_written += 1
        self.bytes_written += buf.nbytes
        return transfer

    def write_error(self, handle: str, error: str) -> None:
        self.store.put(handle + ":error", json.dumps({"error": error[:4096]}).encode())

    def write(self, sample: Sample) -> Future:
        """Queue the put on a writer thread; its future resolves to the transfer manifest."""
        with self._pending_lock:
            # Keep failures for flush(); bound the queue so host memory holds few samples.
            self._pending = [f for f in self._pending if not f.done() or f.exception()]
            running = [f for f in self._pending if not f.done()]
        if len(running) >= 2 * self.config.writer_threads:
            wait(running[:1])
        future = self._pool.submit(self.put, sample)
        with self._pending_lock:
            self._pending.append(future)
        return future

    def flush(self) -> None:
        """Every queued put has finished; raises the first that failed."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        try:
            self.flush()
            self._linger()
        finally:
            self._pool.shutdown(wait=True)

    def _linger(self) -> None:
        if self.config.global_segment_gib <= 0:
            return  # our objects live in other clients' segments and outlive us
        deadline = time.monotonic() + self.config.linger_seconds
        told = False
        while self._outstanding and time.monotonic() < deadline:
            if not self.store.exists(self._outstanding[0][0])[0]:
                self._outstanding.popleft()
                continue
            if not told:
                log.warning("waiting up to %.0fs for consumers to read %d published samples: they live in this "
                            "process's Mooncake segment (mount 0 GiB here and memory on the consumer to exit at "
                            "once)", self.config.linger_seconds, len(self._outstanding))
                told = True
            time.sleep(0.2)


class MooncakeReader:
    """Waits for a sample (or its error marker), validates and decodes it."""

    def __init__(self, manifest: StoreManifest, config: MooncakeConfig):
        self.manifest = manifest
        self.store = MooncakeStore(manifest, config)

    def get(self, sample_id: int, transfer: dict | None = None, timeout: float = 60.0) -> Sample:
        key = transfer["handle"] if transfer else sample_key(self.manifest, sample_id)
        deadline, delay = time.monotonic() + timeout, 0.001
        while True:
            failed, ready = self.store.exists(key + ":error", key)
            if failed:  # a terminal marker wins over waiting
                msg = json.loads(self.store.get(key + ":error").tobytes()).get("error", "unknown error")
                raise ProducerFailed(f"the producer failed sample {sample_id}: {msg}", "see the extractor's log")
            if ready:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"sample {sample_id} did not appear in Mooncake within {timeout:.0f}s ({key})")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if "xxh3_64" not in (transfer or {}).get("metadata", {}):  # the checksum exists only once written
            stored = json.loads(self.store.get(key + ":manifest").tobytes())
            if transfer is not None and any(stored["metadata"].get(k) != v for k, v in transfer["metadata"].items()):
                raise CorruptObject(f"object {key} was written for another request than the one answered",
                                    "it is rejected and can be regenerated")
            transfer = stored
        size = transfer.get("metadata", {}).get("total_aligned_bytes")
        data = self.store.get_into(key, size) if isinstance(size, int) and size > 0 else self.store.get(key)
        sample = unpack(data, transfer, self.manifest)
        if sample.sample_id != sample_id:
            raise CorruptObject(f"object {key} holds sample {sample.sample_id}, expected {sample_id}",
                                "producer and consumer disagree on sample ids (same prepared data?)")
        return sample

    def delete(self, sample: Sample) -> None:
        key = object_key(self.manifest, sample)
        self.store.remove(key, key + ":manifest", key + ":error")


@register_sink("mooncake")
def _make_mooncake_sink(*, manifest: StoreManifest, mooncake: MooncakeConfig | None = None, **_) -> MooncakeSink:
    return MooncakeSink(manifest, mooncake or MooncakeConfig())
