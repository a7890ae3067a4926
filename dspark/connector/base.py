"""The connector's seam: one sample type, one sink protocol, a small registry.

The extractor (transformers engine, `dspark serve`, the vLLM KV connector) hands
each finished sample to one or more sinks; the trainer reads them back through
sources. Sinks register by name so `--to zarr,mooncake` is a lookup, not a branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dspark.errors import InputError


@dataclass
class Sample:
    """One sample's hidden states: `hidden_states [T, L+1, H]` (targets, then last layer pre-norm)."""

    sample_id: int
    token_ids: np.ndarray  # int64 [T]
    hidden_states: torch.Tensor  # [T, L+1, H], the verifier dtype

    def __post_init__(self):
        if self.hidden_states.shape[0] != len(self.token_ids):
            raise ValueError(f"sample {self.sample_id}: {len(self.token_ids)} tokens but "
                             f"{self.hidden_states.shape[0]} hidden-state rows")


class Sink(Protocol):
    name: str

    def has(self, sample_id: int) -> bool: ...

    def write(self, sample: Sample) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


SINKS: dict[str, Callable[..., Sink]] = {}


def register_sink(name: str):
    def deco(factory):
        SINKS[name] = factory
        return factory
    return deco


def parse_sinks(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in SINKS]
    if not names or unknown:
        raise InputError(f"unknown --to target(s) {unknown or spec!r}", f"use one or more of {sorted(SINKS)}, comma-separated")
    return names
