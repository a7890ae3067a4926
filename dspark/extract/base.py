"""The extraction engine seam: what `dspark extract` needs of a verifier runtime.

    open(cfg, verifier, sinks)  builds it from `dspark extract`'s settings, on the resolved verifier
    construct      loads the verifier; `dtype_name` is the dtype its states come in;
                   `writes_elsewhere` says its samples are written by another process
    run(batch, sink)  every (sample id, token ids) of the batch ends up handed to a sink:
                   the transformers engine writes to `sink` in this process; the vLLM engine's
                   own KV connector writes inside vLLM, through sinks built from the same
                   SinkConfig, and `sink` is only consulted for what is already stored
    close()        releases the engine; afterwards every sample it handed over is durable

Engines are found by name (`--engine transformers|vllm`) in `ENGINES` (config.py), each one's module imported only when
chosen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from dspark.connector.base import Sink
from dspark.connector.config import SinkConfig
from dspark.extract.config import ENGINES, ExtractConfig
from dspark.verifier.resolved import Verifier


class Engine(ABC):
    dtype_name: str
    writes_elsewhere: bool = False

    @classmethod
    @abstractmethod
    def open(cls, cfg: ExtractConfig, verifier: Verifier, sinks: SinkConfig) -> Engine:
        """This engine as `dspark extract`'s settings ask for it (a setting it cannot honour is one line)."""

    @abstractmethod
    def run(self, batch: list[tuple[int, np.ndarray]], sink: Sink) -> None: ...

    def close(self) -> None:
        """Nothing held beyond memory by default."""


def engine_class(name: str) -> type[Engine]:
    """The engine `--engine name` chooses, its module imported now; one line for a name no engine has."""
    return ENGINES[name]


def open_engine(cfg: ExtractConfig, verifier: Verifier, sinks: SinkConfig) -> Engine:
    """The engine `cfg.engine` names, built from the extract settings it reads, on the resolved verifier."""
    return engine_class(cfg.engine).open(cfg, verifier, sinks)
