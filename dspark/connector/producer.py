"""What every extractor does with a request: name the sample, answer the client, write it.

Shared by `dspark serve` and the vLLM connector, so their answers are identical and a
trainer cannot tell which engine answered. A request's `kv_transfer_params` may carry
`sample_id` (key the sample by its prepared-data id) and `prepared_fingerprint` (the
data set it belongs to, part of the store identity); a server started with a pinned
data set (a Zarr store) refuses requests for another one.

`plan` is where a client's `kv_transfer_params` are checked: whatever a client sends,
a bad value is an `InputError` (an HTTP 400), never a crash or a key built from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from numbers import Integral

from dspark.connector.base import Sink, close_all
from dspark.connector.config import SinkConfig
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.wire import sample_key, transfer_params
from dspark.core.errors import InputError
from dspark.verifier.resolved import Verifier

# Each data set gets its own manifest and sinks (a Mooncake sink is a client that mounts
# memory): a client naming one random data set per request must not exhaust the host.
MAX_DATA_SETS = 16


@dataclass(frozen=True)
class Planned:
    sample_id: int | None
    handle: str
    prepared_fingerprint: str
    transfer: dict  # what the client gets back in kv_transfer_params


class Producer:
    def __init__(self, config: SinkConfig, model: str | Verifier, target_layer_ids: list[int], dtype: str):
        self.config = config
        self._model, self._layers, self._dtype = Verifier.resolve(model), list(target_layer_ids), dtype
        self._manifests: dict[str, StoreManifest] = {}
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self.manifest(config.prepared_fingerprint or "")  # fail at start, not on the first request

    def manifest(self, prepared_fingerprint: str) -> StoreManifest:
        with self._lock:
            if prepared_fingerprint not in self._manifests:
                if len(self._manifests) >= MAX_DATA_SETS:
                    raise InputError(f"this extractor already writes {len(self._manifests)} data sets, the most "
                                     f"one process takes", "start another extractor for more data sets")
                self._manifests[prepared_fingerprint] = self.config.manifest(
                    self._model, self._layers, prepared_fingerprint, self._dtype)
            return self._manifests[prepared_fingerprint]

    def plan(self, request_id: str, params: dict | None, num_tokens: int) -> Planned:
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise InputError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}",
                             'send {"sample_id": ..., "prepared_fingerprint": ...}')
        sample_id = params.get("sample_id")
        if sample_id is not None:  # an in-process caller may pass numpy ints; a bool is an int too, and refused
            if not (isinstance(sample_id, Integral) and not isinstance(sample_id, bool) and sample_id >= 0):
                raise InputError(f"kv_transfer_params.sample_id must be a non-negative integer, got {sample_id!r:.40}",
                                 "send the prepared-data sample id")
            sample_id = int(sample_id)
        pinned = self.config.prepared_fingerprint
        fingerprint = params.get("prepared_fingerprint") or pinned or ""
        if not (isinstance(fingerprint, str) and len(fingerprint) <= 128):
            raise InputError(f"kv_transfer_params.prepared_fingerprint must be a string (the prepared data's "
                             f"fingerprint), got {fingerprint!r:.40}", "send the prepared data's fingerprint")
        if pinned and fingerprint != pinned:  # never mix two data sets in one store
            raise InputError(f"this extractor writes prepared data {pinned[:12]}, the request is for {fingerprint[:12]}",
                             "start the extractor with the trainer's --data")
        if sample_id is None and self.config.needs_store:
            raise InputError("kv_transfer_params.sample_id is required when writing to a Zarr store",
                             "send the prepared-data sample id")
        manifest = self.manifest(fingerprint)
        handle = sample_key(manifest, sample_id) if sample_id is not None else f"dspark/req/{request_id}"
        return Planned(sample_id, handle, fingerprint, transfer_params(manifest, handle, sample_id, num_tokens))

    def sink(self, prepared_fingerprint: str) -> Sink:
        manifest = self.manifest(prepared_fingerprint)
        with self._lock:
            if prepared_fingerprint not in self._sinks:
                self._sinks[prepared_fingerprint] = self.config.open(manifest)
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
