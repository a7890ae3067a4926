"""`dspark extract --engine vllm`: offline batch extraction with `vllm.LLM` and our KV connector.

The states never come back to this process: the connector inside vLLM copies them
out of the KV cache and writes them through sinks built from the same SinkConfig,
so the store, its manifest and resume behave exactly as with the transformers
engine. vLLM is imported here only, and only when this engine is chosen. Each segment
records the vLLM version and model runner (V1/V2) that extracted it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from dspark.connector.base import Sink
from dspark.connector.config import SinkConfig
from dspark.core.errors import InputError
from dspark.extract.base import Engine
from dspark.extract.config import ExtractConfig
from dspark.extract.launch import CONNECTOR, aux_layer_ids, speculative_config
from dspark.vllm_server import RUNNER_ENV, cpu_env
from dspark.verifier.resolved import Verifier


def expected_runner() -> str:
    """The model runner vLLM will pick: its switch `VLLM_USE_V2_MODEL_RUNNER` if set, else V2 where Triton is
    (vLLM 0.33's default on a GPU; extraction uses none of the features that make it fall back to V1)."""
    import vllm.envs
    from vllm.triton_utils import HAS_TRITON

    v2 = vllm.envs.VLLM_USE_V2_MODEL_RUNNER
    return "v2" if (HAS_TRITON if v2 is None else v2) else "v1"


class VllmEngine(Engine):
    writes_elsewhere = True  # our KV connector writes, inside vLLM's worker

    @classmethod
    def open(cls, cfg: ExtractConfig, verifier: Verifier, sinks: SinkConfig) -> VllmEngine:
        return cls(cfg, verifier, sinks)

    def __init__(self, cfg: ExtractConfig, verifier: Verifier, sinks: SinkConfig):
        dtype = cfg.dtype
        try:
            from vllm import LLM, __version__
        except ImportError:
            raise InputError("vLLM is not installed in this environment",
                             "run from .venv-vllm (bash scripts/setup.sh --vllm), or use --engine transformers") from None
        # On a GPU the weights go to device memory, which vLLM itself checks.
        verifier.check(dtype, host_memory=not torch.cuda.is_available())
        os.environ.update(cpu_env())
        # In-process engine core: a kill -9 of `dspark extract` leaves no orphaned engine behind,
        # and run() can step the engine until the connector has written everything.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # the workers' sinks are built before vLLM has decided, so the record is what it will decide, checked below
        runner = expected_runner()
        sinks = sinks.recording({"vllm_version": __version__, "vllm_model_runner": runner})
        self.llm = LLM(model=str(verifier), dtype=dtype or "auto", trust_remote_code=cfg.trust_remote_code,
                       tensor_parallel_size=cfg.tensor_parallel_size,
                       speculative_config=speculative_config(
                           aux_layer_ids(cfg.target_layer_ids, verifier.info.num_hidden_layers)),
                       kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": sinks.to_extra_config()},
                       enable_prefix_caching=cfg.prefix_caching, enforce_eager=not torch.cuda.is_available(),  # CPU: compiling costs ~50 s of startup
                       disable_log_stats=True)
        if ("v2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "v1") != runner:  # before any write
            raise InputError(f"vLLM chose another model runner than Model Runner {runner.upper()}, which the store's "
                             "segment would record", f"set {RUNNER_ENV}=0 or 1 explicitly")
        self.dtype_name = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.prepared_fingerprint = sinks.prepared_fingerprint

    def run(self, batch: list[tuple[int, np.ndarray]], sink: Sink) -> None:
        from vllm import SamplingParams

        todo = [(sid, tokens) for sid, tokens in batch if not sink.has(sid)]
        params = [SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "sample_id": sid, "prepared_fingerprint": self.prepared_fingerprint}}) for sid, _ in todo]
        self.llm.generate([{"prompt_token_ids": t.tolist()} for _, t in todo], params, use_tqdm=False)
        # generate() returns when the outputs are done; the writes finish on later steps (a request's
        # blocks are freed only once its write is durable), so step until nothing is left.
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        while scheduler.has_requests():
            self.llm.llm_engine.step()
            time.sleep(0.001)  # the writer pool, not the step loop, should have the cores

    def close(self) -> None:
        # Shuts the workers down, which flushes and closes the connector's sinks.
        self.llm.llm_engine.engine_core.shutdown()
