"""Transformers extraction engine: hidden states at the target layers + last layer pre-norm.

Layer id k is the residual stream after decoder layer k-1 (k=0: the embeddings).
We capture them with forward hooks rather than `output_hidden_states=True`:
hooks keep only the layers asked for, and they see the last layer *before* the
final norm, which `hidden_states[-1]` does not in many HF models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.connector.base import Sample, Sink
from dspark.core.errors import InputError
from dspark.extract.base import Engine
from dspark.connector.config import SinkConfig
from dspark.extract.config import ExtractConfig
from dspark.verifier.resolved import Verifier


def decoder_stack(model):
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise InputError(f"{type(model).__name__} has no .model.layers/.embed_tokens",
                         "use a decoder-only causal LM (Llama/Qwen-style)")
    return inner


def capture_layers(model, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """Hook layer ids `layer_ids` of `model`; each forward fills the returned dict with their outputs."""
    captured: dict[int, torch.Tensor] = {}

    def hook(k: int):
        def fn(_module, _inputs, output):
            captured[k] = output[0] if isinstance(output, tuple) else output
        return fn

    dec = decoder_stack(model)
    for k in sorted(set(layer_ids)):
        (dec.embed_tokens if k == 0 else dec.layers[k - 1]).register_forward_hook(hook(k))
    return captured


class TransformersEngine(Engine):
    @classmethod
    def open(cls, cfg: ExtractConfig, verifier: Verifier, sinks: SinkConfig) -> TransformersEngine:
        if cfg.tensor_parallel_size != 1:
            raise InputError(f"--tensor-parallel-size {cfg.tensor_parallel_size} needs the vllm engine",
                             "pass --engine vllm, or run one process per device with --shard INDEX/COUNT")
        return cls(verifier, cfg.target_layer_ids, device=cfg.device, dtype=cfg.dtype,
                   trust_remote_code=cfg.trust_remote_code)

    def __init__(self, model: str | Path | Verifier, target_layer_ids: list[int], *, device: str,
                 dtype: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        verifier = Verifier.resolve(model, fix="pass --model a local Hugging Face model folder").check(dtype)
        path, info = verifier.folder, verifier.info
        self.num_layers = info.num_hidden_layers
        self.hidden_size = info.hidden_size
        self.target_layer_ids = info.check_layer_ids(target_layer_ids)
        self.captured_layer_ids = [*self.target_layer_ids, self.num_layers]
        self.dtype = torch_dtype = getattr(torch, dtype or info.dtype or "float32")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code).to(self.device).eval()
        self._captured = capture_layers(self.model, self.captured_layer_ids)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @torch.inference_mode()
    def extract(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        """Right-padded batched forward; returns `[T_i, L+1, H]` per sample, on the CPU."""
        lengths = [len(ids) for ids in batch]
        T = max(lengths)
        input_ids = torch.zeros(len(batch), T, dtype=torch.long)
        attn = torch.zeros(len(batch), T, dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.as_tensor(ids)
            attn[i, : len(ids)] = 1
        self._captured.clear()
        # Run the decoder stack only: the lm_head over the full vocab is wasted work here.
        decoder_stack(self.model)(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                             use_cache=False)
        stacked = torch.stack([self._captured[k] for k in self.captured_layer_ids], dim=2)  # [B, T, L+1, H]
        stacked = stacked.to("cpu", self.dtype)
        return [stacked[i, :n] for i, n in enumerate(lengths)]  # contiguous views: sinks copy what they keep

    def run(self, batch: list[tuple[int, np.ndarray]], sink: Sink) -> None:
        for (sid, tokens), hidden in zip(batch, self.extract([t for _, t in batch])):
            if not sink.has(sid):
                sink.write(Sample(sid, tokens, hidden))
