"""Reading a sample from Mooncake: wait for it (or its producer's error marker), validate, decode."""

from __future__ import annotations

import json
import time

from dspark.connector.base import Sample
from dspark.connector.config import MooncakeConfig
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.client import OBJECT_NOT_FOUND, MooncakeStore
from dspark.connector.mooncake.errors import CorruptObject, ProducerFailed
from dspark.connector.mooncake.wire import object_key, sample_key, unpack


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
                    self.store.check("get", key + ":manifest", OBJECT_NOT_FOUND)
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
