"""What every extractor does with a request: name the sample, answer the client, write it.

Shared by `dspark serve` and the vLLM connector, so their answers are identical and a
trainer cannot tell which engine answered. A request's `kv_transfer_params` may carry
`sample_id` (key the sample by its prepared-data id) and `prepared_fingerprint` (the
data set it belongs to, part of the store identity); a server started with a pinned
data set (a Zarr store) refuses requests for another one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dspark.connector.base import Sink, close_all, open_sink
from dspark.connector.config import SinkConfig
from dspark.connector.manifest import StoreManifest, manifest_for_model
from dspark.connector.mooncake import sample_key, transfer_params
from dspark.errors import InputError


@dataclass(frozen=True)
class Planned:
    sample_id: int | None
    handle: str
    prepared_fingerprint: str
    transfer: dict  # what the client gets back in kv_transfer_params


class Producer:
    def __init__(self, config: SinkConfig, model: str, target_layer_ids: list[int], dtype: str,
                 trust_remote_code: bool = False):
        self.config = config
        self._model, self._layers, self._dtype, self._trc = model, list(target_layer_ids), dtype, trust_remote_code
        self._manifests: dict[str, StoreManifest] = {}
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self.manifest(config.prepared_fingerprint or "")  # fail at start, not on the first request

    def manifest(self, prepared_fingerprint: str) -> StoreManifest:
        with self._lock:
            if prepared_fingerprint not in self._manifests:
                c = self.config
                self._manifests[prepared_fingerprint] = manifest_for_model(
                    self._model, self._layers, prepared_fingerprint, c.encoding, c.chunk_tokens, c.verifier_name,
                    self._dtype, self._trc)
            return self._manifests[prepared_fingerprint]

    def plan(self, request_id: str, params: dict | None, num_tokens: int) -> Planned:
        params = params or {}
        sample_id = params.get("sample_id")
        pinned = self.config.prepared_fingerprint
        fingerprint = params.get("prepared_fingerprint") or pinned or ""
        if pinned and fingerprint != pinned:  # never mix two data sets in one store
            raise InputError(f"this extractor writes prepared data {pinned[:12]}, the request is for {fingerprint[:12]}",
                             "start the extractor with the trainer's --data")
        if sample_id is None and "zarr" in self.config.to:
            raise InputError("kv_transfer_params.sample_id is required when writing to a Zarr store",
                             "send the prepared-data sample id")
        manifest = self.manifest(fingerprint)
        handle = sample_key(manifest, sample_id) if sample_id is not None else f"dspark/req/{request_id}"
        return Planned(sample_id, handle, fingerprint, transfer_params(manifest, handle, sample_id, num_tokens))

    def sink(self, prepared_fingerprint: str) -> Sink:
        manifest = self.manifest(prepared_fingerprint)
        with self._lock:
            if prepared_fingerprint not in self._sinks:
                c = self.config
                self._sinks[prepared_fingerprint] = open_sink(c.to, store=c.store, manifest=manifest,
                                                              mooncake=c.mooncake)
            return self._sinks[prepared_fingerprint]

    def flush(self) -> None:
        with self._lock:
            sinks = list(self._sinks.values())
        for s in sinks:
            s.flush()

    def close(self) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        close_all(sinks)
