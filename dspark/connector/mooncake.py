"""Mooncake sink and reader: one packed object per sample, live between machines.

Object layout is hs_connectors' transfer format (64-byte-aligned `hidden_states
[T, L+1, H]` then `token_ids [T]`), so either side interoperates with it. The
transfer manifest (layout, sample id, xxh3 checksum, store identity) travels beside the
object: in the HTTP reply of `dspark serve`, and as a small `<key>:manifest`
object written *before* the data, so a producer-driven consumer finds it too.

Visibility: a Mooncake put is atomic, so the data key's presence means the
sample is complete. A producer failure publishes `<key>:error`, on which a waiting
reader raises at once instead of waiting for a timeout; a complete object beside
a marker wins (it is checksum- and identity-checked, so the marker is a stale one
from an earlier attempt at the same key).

Round trips (each costs ~0.1-0.2 ms on loopback, as much as moving 0.1 MB): a put
is one batched upsert of `<key>:manifest` and `<key>` from one registered staging
buffer; a get is one batched read of `<key>:error` (, `<key>:manifest`) and
`<key>` into another. Both buffers are registered once per thread and reused.

Placement: a client that mounts memory puts into its own segment first (Mooncake's
`preferred_segment`; it spills to other segments when its own is full), so a
producer's put is a local memcpy (~3 ms for 50 MB, vs ~50 ms over loopback TCP) and
each object crosses the network once, when a consumer fetches it. Left to the
master, objects land in a random mounted segment: with N mounting clients, a
fraction (N-1)/N of puts cross the network and are then fetched across it again.

Checksums are computed in cache-sized pieces while the bytes are copied (into the
put staging by `pack`, out of the get staging by `unpack`): one pass over memory
instead of two.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from math import prod

import numpy as np
import torch
import xxhash  # ~10x faster than zlib.crc32: the checksum must not be the live path's bottleneck

from dspark.connector.config import MooncakeConfig
from dspark.connector.base import Sample, Sink, register_sink
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest
from dspark.errors import DsparkError
from dspark.fingerprint import sha256_json

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ INFO chatter; our errors say what matters

TRANSFER_VERSION = 1  # hs_connectors' transfer-manifest version
ALIGN = 64
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # the object's put is still landing
BUFFER_TOO_SMALL = -600  # get_into: the object is larger than the buffer given
NO_AVAILABLE_HANDLE = -200  # the store is out of space
GIB = 1 << 30
PIECE = 1 << 20  # copy-and-hash granule: stays in L2 between the copy and the hash
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


def placement(client, cfg: MooncakeConfig):
    """Where this client's puts go: its own segment first when it mounts one (see the module doc)."""
    from mooncake.store import ReplicateConfig

    replicate = ReplicateConfig()
    if cfg.global_segment_gib > 0:
        own = client.get_hostname()  # the segment's name: host:port as registered
        if hasattr(replicate, "preferred_segments"):  # mooncake >= 0.3.10; `preferred_segment` is deprecated
            replicate.preferred_segments = [own]
        elif hasattr(replicate, "preferred_segment"):
            replicate.preferred_segment = own
    return replicate


_NAMESPACES: dict[int, tuple[StoreManifest, str]] = {}  # id -> (the manifest, kept alive so ids stay unique)


def namespace(manifest: StoreManifest) -> str:
    """Keys are scoped by store identity, so two verifiers or layer sets never collide."""
    hit = _NAMESPACES.get(id(manifest))
    if hit is not None and hit[0] is manifest:  # manifests are frozen: a hash per sample is ~30 us wasted
        return hit[1]
    ns = sha256_json(manifest.model_dump(include=set(IDENTITY_FIELDS)))[:16]
    if len(_NAMESPACES) > 64:
        _NAMESPACES.clear()
    _NAMESPACES[id(manifest)] = (manifest, ns)
    return ns


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
        nbytes = prod(shape) * getattr(torch, dtype).itemsize
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
    digest, done = xxhash.xxh3_64(), 0
    for name, raw in (("hidden_states", hidden.view(torch.uint8).reshape(-1).numpy()),
                      ("token_ids", np.ascontiguousarray(sample.token_ids, dtype=np.int64).view(np.uint8))):
        spec = tensors[name]
        if raw.nbytes != spec["nbytes"]:
            raise CorruptObject(f"sample {sample.sample_id}: {name} has {raw.nbytes} bytes, layout says {spec['nbytes']}",
                                "extract with the store's verifier and layer ids")
        start, end = spec["offset"], spec["offset"] + spec["nbytes"]
        for lo in range(start, end, PIECE):  # copy a piece, hash it while it is in cache
            hi = min(lo + PIECE, end)
            buf[lo:hi] = raw[lo - start : hi - start]
            digest.update(buf[done:hi].data)
            done = hi
        buf[end : _align(end)] = 0  # padding, deterministic
    digest.update(buf[done:].data)
    transfer["metadata"]["xxh3_64"] = digest.intdigest()
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
    h, t = expected["hidden_states"], expected["token_ids"]
    # `buf` is reused by the next read: copy out, hashing each piece of the object while it is in cache.
    out = np.empty(h["nbytes"], dtype=np.uint8)
    digest, done = xxhash.xxh3_64(), 0
    for lo in range(h["offset"], h["offset"] + h["nbytes"], PIECE):
        hi = min(lo + PIECE, h["offset"] + h["nbytes"])
        out[lo - h["offset"] : hi - h["offset"]] = buf[lo:hi]
        digest.update(buf[done:hi].data)
        done = hi
    digest.update(buf[done:].data)
    if digest.intdigest() != meta.get("xxh3_64"):
        raise CorruptObject(f"object {key} fails its checksum", "it is rejected and can be regenerated")
    hidden = torch.from_numpy(out).view(getattr(torch, manifest.dtype)).view(*h["shape"])
    tokens = buf[t["offset"] : t["offset"] + t["nbytes"]].view(np.int64).copy()
    return Sample(-1 if meta["sample_id"] is None else int(meta["sample_id"]), tokens, hidden, handle=key)


class MooncakeStore:
    """Thin, error-translating wrapper over one Mooncake client, shared by sink and reader."""

    STAGING_GRANULE = 16 << 20
    ROOM = 64 << 10  # staging room for a transfer manifest or an error marker (~1-5 KiB); larger ones take a slow path

    def __init__(self, manifest: StoreManifest, config: MooncakeConfig):
        self.manifest, self.config = manifest, config
        self.client = connect(config)
        self.replicate = placement(self.client, config)
        self._staging: dict[tuple[int, str], tuple[np.ndarray, int]] = {}

    def staging(self, role: str, nbytes: int) -> tuple[np.ndarray, int]:
        """This thread's registered buffer for `role` and its address: registered once (grown by granules), so
        put_from/get_into move the payload with no extra copy and no allocation per sample."""
        slot = (threading.get_ident(), role)
        hit = self._staging.get(slot)
        if hit is None or hit[0].nbytes < nbytes:
            if hit is not None:
                self.client.unregister_buffer(hit[1])
            cap = -(-max(nbytes, 1) // self.STAGING_GRANULE) * self.STAGING_GRANULE
            buf = np.empty(cap, dtype=np.uint8)
            hit = (buf, buf.ctypes.data)
            self._status("register_buffer", role, self.client.register_buffer(hit[1], cap))
            self._staging[slot] = hit
        return hit

    def publish(self, key: str, nbytes: int, manifest: bytes) -> None:
        """Upsert `<key>:manifest` and `<key>` (the first `nbytes` of this thread's put staging) in one round trip.

        The manifest is staged after the payload; a reader that sees the payload before the manifest
        (the batch is not one atomic put) waits for it, see MooncakeReader.get."""
        buf, ptr = self.staging("put", 0)
        off = _align(nbytes)
        if off + len(manifest) > buf.nbytes:  # no room left after the payload: two round trips
            self.put(key + ":manifest", manifest)
            keys, rcs = [key], [self.client.upsert_from(key, ptr, nbytes, self.replicate)]
        else:
            buf[off : off + len(manifest)] = np.frombuffer(manifest, dtype=np.uint8)
            keys = [key + ":manifest", key]
            rcs = self.client.batch_upsert_from(keys, [ptr + off, ptr], [len(manifest), nbytes], self.replicate)
        for k, rc in zip(keys, rcs):
            self._status("put", k, rc)

    def read(self, key: str, size: int | None, manifest: bool) -> tuple[bytes | None, bytes | None, np.ndarray | None]:
        """`<key>:error`, `<key>:manifest` (if asked) and `<key>` in one round trip; None where absent.

        `size` is what the transfer manifest says the object has (None: unknown, read whatever is there).
        The payload is a view of this thread's get staging, valid until its next read."""
        room = self.ROOM
        buf, ptr = self.staging("get", 2 * room + (size or self.STAGING_GRANULE))
        keys, ptrs, caps = [key + ":error", key], [ptr, ptr + 2 * room], [room, size or buf.nbytes - 2 * room]
        if manifest:
            keys.insert(1, key + ":manifest")
            ptrs.insert(1, ptr + room)
            caps.insert(1, room)
        rcs = self.client.batch_get_into(keys, ptrs, caps)
        out: list = []
        for k, p, rc in zip(keys, ptrs, rcs):
            if rc in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):  # absent, or not yet: the caller polls again
                out.append(None)
            elif rc == BUFFER_TOO_SMALL and k.endswith((":error", ":manifest")):
                out.append(self.get(k).tobytes())  # larger than its room: rare, one more round trip
            elif rc == BUFFER_TOO_SMALL and size is not None:
                raise CorruptObject(f"object {key} has more bytes than the {size} its manifest says",
                                    "the object is not ours or was overwritten; it is rejected and can be regenerated")
            elif rc == BUFFER_TOO_SMALL:  # unknown size, larger than this thread's staging: grow it and read again
                n = self.client.get_size(key)
                self._status("get_size", key, n)
                out.append(self.get_into(key, n))
            else:
                self._status("get", k, rc)
                off = p - ptr
                out.append(buf[off : off + rc] if k == key else buf[off : off + rc].tobytes())
        if not manifest:
            out.insert(1, None)
        return out[0], out[1], out[2]

    def get_into(self, key: str, size: int) -> np.ndarray:
        """Read a `size`-byte object into this thread's staging buffer; the view is valid until the next read."""
        buf, ptr = self.staging("get", 2 * self.ROOM + size)
        got = self.client.get_into(key, ptr + 2 * self.ROOM, size)
        if isinstance(got, int) and got < 0:
            self._status("get", key, got)
        if got != size:
            raise CorruptObject(f"object {key} has {got} bytes, its manifest says {size}",
                                "the object is truncated or not ours; it is rejected and can be regenerated")
        return buf[2 * self.ROOM : 2 * self.ROOM + size]

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
        data = data if isinstance(data, bytes) else data.tobytes()
        self._status("put", key, self.client.upsert(key, data, self.replicate))

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
        """Remove these exact keys in one round trip; a missing one is fine.

        A key whose put is still landing (a manifest batched with the payload just read) is
        retried for up to a second, then left: it is a few bytes nobody will read.
        """
        keys, deadline = list(keys), time.monotonic() + 1.0
        while keys:
            landing = []
            for k, rc in zip(keys, self.client.batch_remove(keys, True)):
                if rc == REPLICA_IS_NOT_READY:
                    landing.append(k)
                elif rc != OBJECT_NOT_FOUND:
                    self._status("remove", k, rc)
            if not landing or time.monotonic() > deadline:
                for k in landing:
                    log.debug("Mooncake object %s was still being written after a second; left in place", k)
                return
            keys = landing
            time.sleep(0.01)


class MooncakeSink(Sink):
    """Publishes samples live, with back-pressure: it never lets unconsumed bytes
    exceed 80% of the segment it mounts, so Mooncake never has to evict a sample
    nobody has read yet, and a put refused for space is retried while consumers
    free it (up to put_timeout). Puts run on --mooncake-writer-threads threads,
    overlapping the next forward; a sample is durable once its put returned.

    Each writer thread packs into its own registered staging buffer, so the lock
    covers only the byte budget, never a put: writer threads overlap their puts."""

    name = "mooncake"

    def __init__(self, manifest: StoreManifest, config: MooncakeConfig):
        self.manifest = manifest
        self.store = MooncakeStore(manifest, config)
        self.config = config
        self._outstanding: dict[str, int] = {}  # key -> bytes, oldest first; a re-put key is counted once
        self._outstanding_bytes = 0
        self._errors: set[str] = set()  # handles this sink published an error marker for
        self._lock = threading.Lock()  # the outstanding-bytes budget and the counters, never held across a put
        self._pending_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, config.writer_threads), thread_name_prefix="mooncake-put")
        self._pending: list[Future] = []
        self.samples_written = self.bytes_written = 0

    def has(self, sample_id: int) -> bool:
        return self.store.exists(sample_key(self.manifest, sample_id))[0]

    def _reserve(self, key: str, nbytes: int) -> None:
        """Count `nbytes` against the budget once there is room (consumers delete what they read)."""
        with self._lock:
            self._release(key)
            if self.config.global_segment_gib > 0:  # else others' memory: a full store answers NO_AVAILABLE_HANDLE
                budget = 0.8 * self.config.global_segment_gib * GIB
                deadline = time.monotonic() + self.config.put_timeout
                while self._outstanding and self._outstanding_bytes + nbytes > budget:
                    oldest = next(iter(self._outstanding))
                    if not self.store.exists(oldest)[0]:  # consumed (deleted) by the trainer
                        self._release(oldest)
                        continue
                    if time.monotonic() > deadline:
                        raise MooncakeFull(f"no consumer freed space for {self.config.put_timeout:.0f}s "
                                           f"({self._outstanding_bytes / 1e6:.1f} MB unconsumed)",
                                           "run the trainer with --on-generate delete, or raise "
                                           "--mooncake-global-segment-gib")
                    time.sleep(0.05)
            self._outstanding[key] = nbytes
            self._outstanding_bytes += nbytes

    def _release(self, key: str) -> None:
        self._outstanding_bytes -= self._outstanding.pop(key, 0)

    def put(self, sample: Sample) -> dict:
        """Publish one sample now; returns its full transfer manifest (with the checksum)."""
        key = object_key(self.manifest, sample)
        _, total = layout(len(sample.token_ids), self.manifest)
        staging, _ = self.store.staging("put", total + MooncakeStore.ROOM)  # this thread's own
        buf, transfer = pack(sample, self.manifest, key, staging)
        self._reserve(key, buf.nbytes)
        try:
            if key in self._errors:  # our own earlier failure must not shadow this sample for error-first readers
                self.store.remove(key + ":error")
                self._errors.discard(key)
            manifest = json.dumps(transfer).encode()
            deadline = time.monotonic() + self.config.put_timeout
            while True:
                try:
                    self.store.publish(key, buf.nbytes, manifest)
                    break
                except MooncakeFull:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # space frees as consumers delete
        except BaseException:
            with self._lock:
                self._release(key)
            raise
        with self._lock:
            self.samples_written += 1
            self.bytes_written += buf.nbytes
        return transfer

    def write_error(self, handle: str, error: str) -> None:
        self.store.put(handle + ":error", json.dumps({"error": error[:4096]}).encode())
        self._errors.add(handle)

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
            oldest = next(iter(self._outstanding))
            if not self.store.exists(oldest)[0]:
                self._release(oldest)
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
        meta = (transfer or {}).get("metadata", {})
        need_manifest = "xxh3_64" not in meta  # the checksum exists only once written: read the producer's manifest
        size = meta.get("total_aligned_bytes")
        size = size if isinstance(size, int) and size > 0 else None
        deadline, delay, orphan_since = time.monotonic() + timeout, 0.001, None
        while True:  # each poll is one round trip: marker, manifest and payload together
            error, stored, data = self.store.read(key, size, need_manifest)
            if data is not None and (stored is not None or not need_manifest):
                break  # complete; beside it a marker can only be stale, and the object passes its checks below
            if data is None and error is not None:  # a terminal marker wins over waiting
                try:
                    msg = json.loads(error).get("error", "unknown error")
                except (ValueError, AttributeError):
                    msg = error.decode(errors="replace")
                raise ProducerFailed(f"the producer failed sample {sample_id}: {msg}", "see the extractor's log")
            if data is not None:  # the payload without its manifest: the batch put is landing, or none was written
                orphan_since = orphan_since or time.monotonic()
                if time.monotonic() - orphan_since > 1.0:  # a batch lands in milliseconds
                    self.store._status("get", key + ":manifest", OBJECT_NOT_FOUND)
            if time.monotonic() > deadline:
                raise TimeoutError(f"sample {sample_id} did not appear in Mooncake within {timeout:.0f}s ({key})")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if need_manifest:
            try:
                stored = json.loads(stored)
            except ValueError:
                raise CorruptObject(f"object {key}:manifest is not a transfer manifest",
                                    "it is rejected and can be regenerated") from None
            if transfer is not None and any(stored["metadata"].get(k) != v for k, v in transfer["metadata"].items()):
                raise CorruptObject(f"object {key} was written for another request than the one answered",
                                    "it is rejected and can be regenerated")
            transfer = stored
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
