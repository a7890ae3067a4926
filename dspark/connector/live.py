"""The trainer's live source: local Zarr cache first, then the extraction server + Mooncake.

    read(id): cache hit -> cache (checksum verified)
              damaged   -> a cached sample that fails its checksum or decode counts as a miss:
                           fetched again and written through; readers take the new copy
              miss      -> ask --vllm-endpoint to extract it (or, with no endpoint, wait for a
                           producer-driven `dspark extract --to mooncake`), read it from Mooncake,
                           validate it, write it through to the cache, delete it from Mooncake

A sample already cached is never fetched or regenerated, so later epochs and
replays read the cache only. Only whole, validated samples are ever written to the cache.

When the live source fails, the sample is skipped (training continues on cached
samples; the trainer records which were skipped, so a replay leaves out the same),
the degradation is logged once per outage, and live reads resume when it is back:
  down     the extraction server fails its liveness check (GET /health within half
           --stall-timeout): refused, or hung (a stopped server still accepts connections,
           so a request to it would wait out --request-timeout). Found within --stall-timeout
           of a request in flight; then every miss is skipped at once, with no request, while
           a thread asks /health every PROBE_SECONDS; a batch left with no sample waits for
           it instead (`wait_for_recovery`), so a cold cache does not skip a whole epoch. Down
           past --max-down-seconds, the run stops with a clear error (time, not a count: a
           server restart can be waited out).
  failing  the server answers /health but its requests fail (a 5xx, the Mooncake master
           gone, wrong values): after --max-consecutive-generation-failures in a row the
           run stops with a clear error. Without an endpoint every failure counts here. A
           failure is retried (--max-retries) unless the Mooncake master takes no connection:
           no retry can succeed without it.
Once either stops the run, no read sends another request or retry (one in flight runs its
course), and the trainer's loader drops the reads it had queued.
"""

from __future__ import annotations

import http.client
import json
import logging
import select
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from dspark.connector.config import LiveConfig
from dspark.connector.base import PromptSet, Sample, Source
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.client import unreachable
from dspark.connector.mooncake.errors import CorruptObject, MooncakeError, MooncakeUnavailable, ProducerFailed
from dspark.connector.mooncake.reader import MooncakeReader
from dspark.connector.zarr.reader import ZarrStore
from dspark.connector.zarr.writer import ZarrSink
from dspark.core.errors import DamagedSample, DsparkError, StoreError

log = logging.getLogger("dspark.live")


PROBE_SECONDS = 1.0  # while the server is down, how often it is asked whether it is back


class LiveSourceDown(DsparkError):
    """The live source stayed down or failing past its budget: stop rather than train on a shrinking data set."""


class ServerDown(Exception):
    """The extraction server failed its liveness check: hung or gone (not an error of one request)."""


class ExtractionClient:
    """The OpenAI completions call vLLM (with our connector) and `dspark serve` both answer, plus GET /health."""

    def __init__(self, endpoint: str, timeout: float, stall_timeout: float, prepared_fingerprint: str):
        self.base = endpoint.rstrip("/")
        parts = urllib.parse.urlsplit(self.base)
        self.health_url = f"{parts.scheme}://{parts.netloc}/health"  # vLLM and `dspark serve` answer it at the root
        self._connection = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection,
                            parts.hostname, parts.port, parts.path + "/completions")
        self.timeout = timeout
        self.probe_timeout = stall_timeout / 2  # wait this long for a reply, then this long for /health
        self.prepared_fingerprint = prepared_fingerprint  # scopes the server's keys to our data set
        self.requests = 0
        self.model: str | None = None

    def alive(self) -> bool:
        """Whether the server answers GET /health within half the stall timeout (it runs no forward)."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=self.probe_timeout) as r:
                return r.status == 200
        except (OSError, ValueError, http.client.HTTPException):
            return False

    def _model(self) -> str:
        """The served model's name (vLLM refuses any other); asked once."""
        if self.model is None:
            with urllib.request.urlopen(self.base + "/models", timeout=self.probe_timeout) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
        return self.model

    def _post(self, body: bytes) -> dict:
        """POST /completions; waits up to the request timeout for the reply while the server stays alive.

        An extraction may rightly take long; a hung server would take all of it (and its retries),
        so every half stall timeout without a reply the server must pass its liveness check.
        """
        kind, host, port, path = self._connection
        conn = kind(host, port, timeout=self.probe_timeout)  # bounds the connect, the send and each reply read
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            deadline = time.monotonic() + self.timeout
            while not _readable(conn.sock, min(self.probe_timeout, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no reply within --request-timeout {self.timeout:g} s")
                if not self.alive():
                    raise ServerDown(f"the extraction server at {self.base} stopped answering: no reply, and no "
                                     f"answer to its liveness check ({self.health_url}) within "
                                     f"{self.probe_timeout:g} s")
            r = conn.getresponse()
            data = r.read()
        except http.client.HTTPException as e:  # a reply cut off (the server died mid-send) or garbled
            raise ConnectionError(f"the extraction server at {self.base} broke off its reply: {e!r}") from e
        finally:
            conn.close()
        if r.status != 200:
            raise OSError(f"HTTP {r.status} from {self.base}/completions: {data[:300].decode(errors='replace')}")
        return json.loads(data)

    def extract(self, sample_id: int, token_ids: list[int]) -> dict:
        params = {"sample_id": sample_id, "prepared_fingerprint": self.prepared_fingerprint}
        body = json.dumps({"model": self._model(), "prompt": token_ids, "max_tokens": 1, "return_token_ids": True,
                           "kv_transfer_params": params}).encode()
        self.requests += 1
        reply = self._post(body)
        if reply["choices"][0].get("prompt_token_ids") != token_ids:
            raise CorruptObject(f"sample {sample_id}: the server echoed other prompt token ids",
                                "the endpoint serves another tokenizer or truncated the prompt")
        return reply["kv_transfer_params"]


def _readable(sock, seconds: float) -> bool:
    """Whether the server has begun its reply within `seconds` (read nothing: http.client reads it)."""
    return bool(select.select([sock], [], [], max(0.0, seconds))[0])


class TieredSource(Source):
    live = True

    def __init__(self, cache_root: str, manifest: StoreManifest, prompts: PromptSet, cfg: LiveConfig):
        self.cfg, self.prompts = cfg, prompts
        self.sink = ZarrSink(cache_root, manifest)  # creates the cache (or checks it matches)
        self.cache = ZarrStore(cache_root)
        self.manifest, self.location = self.cache.manifest, self.cache.location
        self.client = (ExtractionClient(cfg.endpoint, cfg.request_timeout, cfg.stall_timeout, prompts.fingerprint)
                       if cfg.endpoint else None)
        self._reader: MooncakeReader | None = None
        self._lock = threading.Lock()
        self._failures = 0  # failed requests in a row to a server that is up
        self._degraded = False  # said once per outage, cleared by the next sample fetched
        self._down: tuple[float, ServerDown] | None = None  # since when (monotonic) the server is down, and why
        self._prober: threading.Thread | None = None
        self._gave_up: LiveSourceDown | None = None  # the run stops: later misses send no request
        self._closed = threading.Event()
        self._stats = {"cache_hits": 0, "generated": 0, "skipped": 0, "failures": 0, "damaged_refetched": 0}
        if cfg.on_missing == "generate" and len(self.cache) < len(prompts):
            # Misses will be fetched: a wrong or dead --mooncake-master is one line now, not a stop after
            # the first misses' retries (or a wait on the endpoint). A complete cache needs no master.
            self._reader_or_connect()

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

    def wait_for_recovery(self, stop: threading.Event) -> bool:
        """A batch with no sample left waits out an outage (up to --max-down-seconds) rather than
        skipping batch after batch in a second: the cache keeps training only on what it holds."""
        if self.cfg.on_missing != "generate":
            return False
        while self._down is not None:
            with self._lock:
                self._check_down_budget()
            if stop.wait(0.1):
                return False
        return True

    def close(self) -> None:
        self._closed.set()
        if self._prober is not None:
            self._prober.join()
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
        self._stop_if_gave_up()
        if self._down is not None:  # no request while it is down: the prober says when it is back
            return self._skip_while_down()
        try:
            sample = self._fetch(sample_id)
        except ServerDown as e:
            return self._went_down(e)
        except (MooncakeError, OSError, TimeoutError, urllib.error.URLError) as e:
            return self._failed(e)
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
            if attempt:  # another read stopped the run meanwhile: no retry (an in-flight request may run its time)
                self._stop_if_gave_up()
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
                if self.client and not self.client.alive():  # retries cannot help: wait for it to come back
                    raise ServerDown(f"the extraction server at {self.client.base} does not answer its liveness "
                                     f"check; {type(e).__name__}: {e}") from e
                if (why := unreachable(master := self.cfg.mooncake.master)) is not None:  # nor without the master
                    raise MooncakeUnavailable(f"cannot reach the Mooncake master at {master} ({why}); "
                                              f"{type(e).__name__}: {e}") from e
                if attempt >= self.cfg.max_retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))
        raise last  # pragma: no cover - the loop always returns or raises

    _RERUN = ("rerun the same command: training resumes from the latest checkpoint, and every sample cached so far "
              "is kept")

    def _degrade(self, e: Exception) -> None:
        """Count one skipped sample; say so once per outage. Under the lock."""
        self._stats["failures"] += 1
        self._stats["skipped"] += 1
        if not self._degraded:
            log.warning("live source degraded (%s: %s); training continues on cached samples and skips the others "
                        "(the run record names them); live reads resume when it is back", type(e).__name__, e)
            self._degraded = True

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self._failures += 1
            self._degrade(e)
            if self._failures >= self.cfg.max_consecutive_generation_failures:
                self._give_up(f"{self._failures} consecutive live extraction failures (last: {type(e).__name__}: {e})",
                              f"bring the endpoint/Mooncake master back and {self._RERUN}")
        return None

    def _went_down(self, e: ServerDown) -> None:
        with self._lock:
            self._degrade(e)
            if self._down is None:
                self._down = time.monotonic(), e
                self._prober = threading.Thread(target=self._probe, daemon=True, name="dspark-live-probe")
                self._prober.start()
            self._check_down_budget()
        return None

    def _skip_while_down(self) -> None:
        with self._lock:
            self._stats["skipped"] += 1
            self._check_down_budget()
        return None

    def _check_down_budget(self) -> None:
        """Under the lock: a server down past --max-down-seconds stops the run."""
        if self._down is not None and (down := time.monotonic() - self._down[0]) > self.cfg.max_down_seconds:
            self._give_up(f"the live source has been down for {down:.0f} s, more than --max-down-seconds "
                          f"{self.cfg.max_down_seconds:g} ({self._down[1]})",
                          f"bring the extraction server back and {self._RERUN}")

    def _give_up(self, what: str, fix: str) -> None:
        """Under the lock: stop the run; the reads still in flight or queued stop too, with no further request."""
        self._gave_up = LiveSourceDown(what, fix)
        self._stop_if_gave_up()

    def _stop_if_gave_up(self) -> None:
        """A fresh exception per read: one object raised in several threads would share its traceback."""
        if (e := self._gave_up) is not None:
            raise LiveSourceDown(e.what, e.fix)

    def _probe(self) -> None:
        """While the server is down: ask /health until it answers, then let misses send requests again."""
        while not self._closed.wait(PROBE_SECONDS):
            if self.client.alive():
                with self._lock:
                    self._down = None
                return


def open_source(*, store: str, manifest: StoreManifest, prompts: PromptSet, live: LiveConfig, **_) -> TieredSource:
    """The SOURCES factory (registry.py): the live source, caching into the store folder `store`."""
    return TieredSource(store, manifest, prompts, live)
