"""Publishing samples live, with back-pressure.

Visibility: a Mooncake put is atomic, so the data key's presence means the
sample is complete. A producer failure publishes `<key>:error`, on which a waiting
reader raises at once instead of waiting for a timeout; a complete object beside
a marker wins (it is checksum- and identity-checked, so the marker is a stale one
from an earlier attempt at the same key).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from dspark.connector.base import Sample, Sink
from dspark.connector.config import MooncakeConfig
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.client import GIB, MooncakeStore, log
from dspark.connector.mooncake.errors import MooncakeFull
from dspark.connector.mooncake.wire import layout, object_key, pack, sample_key


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


def open_sink(*, manifest: StoreManifest, mooncake: MooncakeConfig | None = None, **_) -> MooncakeSink:
    """The SINKS factory (registry.py): a live sink, publishing through the Mooncake master `mooncake` names."""
    return MooncakeSink(manifest, mooncake or MooncakeConfig())
