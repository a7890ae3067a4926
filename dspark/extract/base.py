"""The extraction engine seam: what `dspark extract` needs of a verifier runtime.

    construct      loads the verifier; `dtype_name` is the dtype its states come in;
                   `writes_elsewhere` says its samples are written by another process
    run(batch, sink)  every (sample id, token ids) of the batch ends up handed to a sink:
                   the transformers engine writes to `sink` in this process; the vLLM engine's
                   own KV connector writes inside vLLM, through sinks built from the same
                   SinkConfig, and `sink` is only consulted for what is already stored
    close()        releases the engine; afterwards every sample it handed over is durable

Engines register by name (`--engine transformers|vllm`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from dspark.connector.base import Registry, Sink
from dspark.connector.config import SinkConfig


class Engine(ABC):
    dtype_name: str
    writes_elsewhere: bool = False

    @abstractmethod
    def run(self, batch: list[tuple[int, np.ndarray]], sink: Sink) -> None: ...

    def close(self) -> None:
        """Nothing held beyond memory by default."""


ENGINES = Registry("engine", "--engine")


def open_engine(name: str, *, model: str, target_layer_ids: list[int], sinks: SinkConfig, device: str = "cpu",
                dtype: str | None = None, trust_remote_code: bool = False, prefix_caching: bool = True,
                tensor_parallel_size: int = 1) -> Engine:
    import dspark.extract.transformers_engine  # noqa: F401  (registration)
    import dspark.extract.vllm_engine  # noqa: F401

    ENGINES.parse(name)
    return ENGINES[name](model=model, target_layer_ids=target_layer_ids, sinks=sinks, device=device, dtype=dtype,
                         trust_remote_code=trust_remote_code, prefix_caching=prefix_caching,
                         tensor_parallel_size=tensor_parallel_size)
