"""The trainer's live source: local Zarr cache first, then the extraction server + Mooncake.

    read(id): cache hit -> cache (checksum verified)
              damaged   -> a cached sample that fails its checksum or decode counts as a miss:
                           fetched again and written through; readers take the new copy
              miss      -> ask --vllm-endpoint to extract it (or, with no endpoint, wait for a
                           producer-driven `dspark extract --to mooncake`), read it from Mooncake,
                           validate it, write it through to the cache, delete it from Mooncake

A sample already cached is never fetched or regenerated, so later epochs and
replays read the cache only. When the endpoint or the master fails, the sample
is skipped (training continues on cached samples), the degradation is logged
once, live reads resume when the service is back, and after
--max-consecutive-generation-failures in a row training stops with a clear
error. Only whole, validated samples are ever written to the cache.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from dspark.config import LiveConfig
from dspark.connector.base import PromptSet, Sample, Source, register_source
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake import CorruptObject, MooncakeError, MooncakeReader, ProducerFailed
from dspark.connector.zarr_store import ZarrSink, ZarrStore
from dspark.errors import DamagedSample, DsparkError, StoreError

log = logging.getLogger("dspark.live")


class LiveSourceDown(DsparkError):
    """Too many consecutive live failures: stop rather than train on a shrinking data set."""


class ExtractionClient:
    """The OpenAI completions call vLLM (with our connector) and `dspark serve` both answer."""

    def __init__(self, endpoint: str, timeout: float, prepared_fingerprint: str):
        self.url = endpoint.rstrip("/") + "/completions"
        self.timeout = timeout
        self.prepared_fingerprint = prepared_fingerprint  # scopes the server's keys to our data set
        self.requests = 0
        self.model: str | None = None

    def _model(self) -> str:
        """The served model's name (vLLM refuses any other); asked once."""
        if self.model is None:
            with urllib.request.urlopen(self.url.removesuffix("/completions") + "/models", timeout=self.timeout) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
        return self.model

    def extract(self, sample_id: int, token_ids: list[int]) -> dict:
        params = {"sample_id": sample_id, "prepared_fingerprint": self.prepared_fingerprint}
        body = json.dumps({"model": self._model(), "prompt": token_ids, "max_tokens": 1, "return_token_ids": True,
                           "kv_transfer_params": params}).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        self.requests += 1
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            reply = json.loads(r.read())
        if reply["choices"][0].get("prompt_token_ids") != token_ids:
            raise CorruptObject(f"sample {sample_id}: the server echoed other prompt token ids",
                                "the endpoint serves another tokenizer or truncated the prompt")
        return reply["kv_transfer_params"]


class TieredSource(Source):
    live = True

    def __init__(self, cache_root: str, manifest: StoreManifest, prompts: PromptSet, cfg: LiveConfig):
        self.cfg, self.prompts = cfg, prompts
        self.sink = ZarrSink(cache_root, manifest)  # creates the cache (or checks it matches)
        self.cache = ZarrStore(cache_root)
        self.manifest, self.location = self.cache.manifest, self.cache.location
        self.client = (ExtractionClient(cfg.endpoint, cfg.request_timeout, prompts.fingerprint)
                       if cfg.endpoint else None)
        self._reader: MooncakeReader | None = None
        self._lock = threading.Lock()
        self._failures = 0
        self._degraded = False
        self._stats = {"cache_hits": 0, "generated": 0, "skipped": 0, "failures": 0, "damaged_refetched": 0}

    # --- the Source interface the trainer uses ---------------------------------
    @property
    def sample_ids(self) -> list[int]:
        return list(range(len(self.prompts)))

    @property
    def stats(self) -> dict:
        return {**self._stats, "requests": self.client.requests if self.client else 0}

    def fingerprint(self) -> str:
        with self._lock:
            self.cache.refresh()
            return self.cache.fingerprint()

    def read(self, sample_id: int) -> Sample | None:
        with self._lock:
            if sample_id not in self.cache and self.sink.has(sample_id):
                self.cache.refresh()
            hit = sample_id in self.cache
            self._stats["cache_hits"] += hit
        if not hit:
            return self._miss(sample_id)
        try:  # outside the lock: the loader's threads read the cache concurrently
            return self.cache.read(sample_id)
        except DamagedSample as e:
            if self.cfg.on_missing != "generate":
                raise  # nothing to fetch it from: the trainer's --on-damaged decides
            log.warning("%s: fetching it again", e.what)
            with self._lock:
                self._stats["damaged_refetched"] += 1
                self.sink.rewrite([sample_id])
            return self._miss(sample_id)

    def close(self) -> None:
        with self._lock:
            self.sink.close()

    # --- misses ---------------------------------------------------------------
    def _miss(self, sample_id: int) -> Sample | None:
        mode = self.cfg.on_missing
        if mode == "raise":
            raise StoreError(f"sample {sample_id} is not in the cache {self.cache.root}",
                             "extract it first, or use --on-missing generate")
        if mode in ("skip", "warn"):
            if mode == "warn":
                log.warning("sample %d is not cached; skipped (--on-missing warn)", sample_id)
            self._stats["skipped"] += 1
            return None
        try:
            sample = self._fetch(sample_id)
        except (MooncakeError, OSError, TimeoutError, urllib.error.URLError) as e:
            return self._failed(sample_id, e)
        with self._lock:
            if not self.sink.has(sample_id):
                self.sink.write(sample)
                self.sink.flush()  # visible to later epochs (and a killed run) at once
                if sample_id in self.cache:  # it replaces a damaged copy: index the new one now
                    self.cache.refresh()
            self._failures = 0
            if self._degraded:
                log.warning("live source is back: extraction requests succeed again")
                self._degraded = False
            self._stats["generated"] += 1
        return sample

    def _reader_or_connect(self) -> MooncakeReader:
        with self._lock:  # one client per process, however many loader threads miss at once
            if self._reader is None:
                self._reader = MooncakeReader(self.manifest, self.cfg.mooncake)
            return self._reader

    def _fetch(self, sample_id: int) -> Sample:
        tokens = self.prompts.token_ids(sample_id)
        attempts = 1 + max(self.cfg.max_retries, self.cfg.generation_validation_retries)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                # Connect first: the producer may mount no memory, so its put needs our segment.
                reader = self._reader_or_connect()
                transfer = self.client.extract(sample_id, tokens.tolist()) if self.client else None
                sample = reader.get(sample_id, transfer, timeout=self.cfg.request_timeout)
                if not np.array_equal(sample.token_ids, tokens):
                    raise CorruptObject(f"sample {sample_id}: stored token ids differ from the prepared data",
                                        "producer and trainer must use the same prepared data")
                if self.cfg.on_generate == "delete":
                    reader.delete(sample)
                return sample
            except (CorruptObject, ProducerFailed) as e:  # wrong values: ask again
                last = e
                if attempt >= self.cfg.generation_validation_retries or not self.client:
                    raise
            except (OSError, TimeoutError, urllib.error.URLError, MooncakeError) as e:  # unreachable: back off
                last = e
                if attempt >= self.cfg.max_retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))
        raise last  # pragma: no cover - the loop always returns or raises

    def _failed(self, sample_id: int, e: Exception) -> None:
        with self._lock:
            self._failures += 1
            self._stats["failures"] += 1
            self._stats["skipped"] += 1
            if not self._degraded:
                log.warning("live source degraded (%s: %s); training continues on cached samples, "
                            "live reads resume when it is back", type(e).__name__, e)
                self._degraded = True
            if self._failures >= self.cfg.max_consecutive_generation_failures:
                raise LiveSourceDown(
                    f"{self._failures} consecutive live extraction failures (last: {type(e).__name__}: {e})",
                    "bring the endpoint/Mooncake master back and rerun the same command: training resumes from "
                    "the latest checkpoint, and every sample cached so far is kept")
        return None


@register_source("mooncake")
def _open_live_source(*, store: str, manifest: StoreManifest, prompts: PromptSet, live: LiveConfig, **_) -> TieredSource:
    return TieredSource(store, manifest, prompts, live)
