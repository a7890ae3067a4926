"""The verifier in a decode loop: a transformers causal LM with its KV cache and captured states.

Each forward appends tokens to the cache and returns their next-token logits (banned tokens,
if the request has any, at -inf) and the target-layer states the drafter reads; `rewind` drops
the rejected tail of the cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.errors import InputError


class Verifier:
    def __init__(self, path: str | Path, target_layer_ids: list[int], dtype: str = "float32",
                 device: torch.device = torch.device("cpu"), trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        from dspark.extract.transformers_engine import capture_layers

        if not (Path(path) / "config.json").exists():
            raise InputError(f"verifier folder {path} has no config.json", "pass --verifier-name-or-path the "
                             "local verifier folder the drafter was trained on")
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code).to(device).eval()
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.device = device
        self.layer_ids = list(target_layer_ids)
        self._captured = capture_layers(self.model, self.layer_ids)
        self.cache = None
        self.length = 0
        self.banned: list[int] = []

    def reset(self, banned: set[int] = frozenset()) -> None:
        """A new request. `banned` tokens get no probability (vLLM's `ignore_eos` bans the stop tokens)."""
        from transformers import DynamicCache

        self.cache, self.length, self.banned = DynamicCache(config=self.model.config), 0, sorted(banned)

    @torch.no_grad()
    def forward(self, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `ids`; returns float32 logits `[n, vocab]` and target-layer states `[n, layers*hidden]`."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.length += ids.shape[1]
        states = torch.cat([self._captured[k][0] for k in self.layer_ids], dim=-1)
        logits = out.logits[0].float()
        logits[:, self.banned] = float("-inf")
        return logits, states

    def rewind(self, length: int) -> None:
        """Keep the first `length` positions of the cache (the verified tokens)."""
        if length < self.length:  # transformers deprecates crop(keep) for crop(-drop)
            self.cache.crop(length - self.length)
        self.length = length
