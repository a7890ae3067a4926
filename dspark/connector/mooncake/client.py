"""One Mooncake client: connecting to the master, placement, and error-translating reads and writes.

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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np

from dspark.connector.config import MooncakeConfig
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.errors import (CorruptObject, MooncakeError, MooncakeFull, MooncakeUnavailable,
                                              ObjectGone)
from dspark.connector.mooncake.wire import align

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's C++ INFO chatter; our errors say what matters

OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # the object's put is still landing
BUFFER_TOO_SMALL = -600  # get_into: the object is larger than the buffer given
NO_AVAILABLE_HANDLE = -200  # the store is out of space
GIB = 1 << 30
log = logging.getLogger("dspark.mooncake")


def master_binary() -> str:
    """`mooncake_master` as shipped in the wheel, also when the venv's bin/ is not on PATH."""
    import shutil
    import sys
    from pathlib import Path

    for candidate in (shutil.which("mooncake_master"), Path(sys.executable).parent / "mooncake_master"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise MooncakeError("mooncake_master is not installed", "pip install 'dspark[mooncake]'")


def unreachable(master: str) -> str | None:
    """Why the Mooncake master at `master` (host:port) takes no TCP connection within 2 s, or None if it does."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=2).close()
    except (OSError, ValueError) as e:
        return str(e)
    return None


def _check_reachable(master: str) -> None:
    if (why := unreachable(master)) is not None:
        raise MooncakeUnavailable(f"cannot reach the Mooncake master at {master} ({why})",
                                  "start it (mooncake_master --rpc_port 50051 ...) or fix --mooncake-master")


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
            self.check("register_buffer", role, self.client.register_buffer(hit[1], cap))
            self._staging[slot] = hit
        return hit

    def publish(self, key: str, nbytes: int, manifest: bytes) -> None:
        """Upsert `<key>:manifest` and `<key>` (the first `nbytes` of this thread's put staging) in one round trip.

        The manifest is staged after the payload; a reader that sees the payload before the manifest
        (the batch is not one atomic put) waits for it, see MooncakeReader.get."""
        buf, ptr = self.staging("put", 0)
        off = align(nbytes)
        if off + len(manifest) > buf.nbytes:  # no room left after the payload: two round trips
            self.put(key + ":manifest", manifest)
            keys, rcs = [key], [self.client.upsert_from(key, ptr, nbytes, self.replicate)]
        else:
            buf[off : off + len(manifest)] = np.frombuffer(manifest, dtype=np.uint8)
            keys = [key + ":manifest", key]
            rcs = self.client.batch_upsert_from(keys, [ptr + off, ptr], [len(manifest), nbytes], self.replicate)
        for k, rc in zip(keys, rcs):
            self.check("put", k, rc)

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
                self.check("get_size", key, n)
                out.append(self.get_into(key, n))
            else:
                self.check("get", k, rc)
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
            self.check("get", key, got)
        if got != size:
            raise CorruptObject(f"object {key} has {got} bytes, its manifest says {size}",
                                "the object is truncated or not ours; it is rejected and can be regenerated")
        return buf[2 * self.ROOM : 2 * self.ROOM + size]

    def check(self, op: str, key: str, rc) -> None:
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
            self.check("is_exist", k, rc)
        return [rc == 1 for rc in rcs]

    def put(self, key: str, data) -> None:
        """Upsert: a regenerated sample replaces a stale object (a plain put keeps the first)."""
        data = data if isinstance(data, bytes) else data.tobytes()
        self.check("put", key, self.client.upsert(key, data, self.replicate))

    def get(self, key: str, size: int | None = None) -> np.ndarray:
        """The object's bytes; with `size` known (from a manifest) this is one round trip."""
        if size is None:
            size = self.client.get_size(key)
            self.check("get_size", key, size)
        data = self.client.get(key)
        if not data:
            self.check("get", key, OBJECT_NOT_FOUND)
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
                    self.check("remove", k, rc)
            if not landing or time.monotonic() > deadline:
                for k in landing:
                    log.debug("Mooncake object %s was still being written after a second; left in place", k)
                return
            keys = landing
            time.sleep(0.01)
