"""The commands one deployment file (configs/*.yaml) configures: its section names and their typed configs.

Light on purpose (no torch, no click): `launch-vllm` reads its section inside vLLM's environment. It sits
above the configs it names, so the entry points hand it down (`--config`, `launch-vllm`'s `main`).
"""
from __future__ import annotations

from dspark.connector.config import MasterConfig
from dspark.extract.config import ExtractConfig, LaunchConfig
from dspark.data.prepare import PrepareConfig
from dspark.train.config import TrainConfig

SECTIONS = {"prepare": PrepareConfig, "extract": ExtractConfig, "launch-vllm": LaunchConfig,
            "mooncake-master": MasterConfig, "train": TrainConfig}
