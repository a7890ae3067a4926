"""The verifier in a decode loop: a transformers causal LM with its KV cache and captured states.

Each forward appends tokens to the cache and returns their next-token logits (banned tokens,
if the request has any, at -inf) and the target-layer states the drafter reads; `rewind` drops
the rejected tail of the cache. A prompt's forward needs the last position's logits only
(`last_only`: the lm_head over every prompt token was a fifth of a 135M verifier's prefill),
and `resume` goes back to a prompt's cache to decode it again without another forward.

Attention runs through `GQA_SDPA`, transformers' sdpa attention except that grouped-query
key/value heads are read in place under a mask too: transformers repeats each of them
`num_key_value_groups` times whenever the forward has a mask (every verification, 1 + drafts
tokens), a copy of the whole cache per layer that cost more than the attention itself on CPU
(SmolLM2-135M, 9 heads on 3, 7K tokens of context: ~30 ms against ~4 ms per layer call). Here the
query heads sharing a key/value head attend as one longer query (each row's result is the same).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.verifier.info import VerifierInfo
from dspark.verifier.check import check_verifier_config


GQA_SDPA = "dspark_gqa_sdpa"


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, q, d = query.shape
    if attention_mask.shape[1] != 1:  # a mask per head
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    # the query heads of one key/value head as one longer query (head h reads key/value head h // groups)
    grouped = query.reshape(b, heads // groups, groups * q, d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value,
                                                           attn_mask=attention_mask.repeat(1, 1, groups, 1),
                                                           dropout_p=dropout, scale=scaling)
    return out.view(b, heads, q, d).transpose(1, 2).contiguous(), None


def _use_gqa_sdpa(model) -> None:
    """Switch a model that runs transformers' sdpa attention to `GQA_SDPA` (same masks); others are left as they are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    if GQA_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
        AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)


class Verifier:
    def __init__(self, path: str | Path, target_layer_ids: list[int], dtype: str,
                 device: torch.device = torch.device("cpu"), trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        from dspark.extract.transformers_engine import capture_layers

        info = VerifierInfo.load(
            path, noun="verifier folder",
            fix="pass --verifier-name-or-path the local verifier folder the drafter was trained on")
        check_verifier_config(info, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code).to(device).eval()
        _use_gqa_sdpa(self.model)
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

    def resume(self, cache, length: int, banned: list[int]) -> None:
        """Continue from `cache` (a request's, from an earlier `reset` and forward) cut back to its first `length`
        positions: cropping leaves the kept keys and values as that forward computed them."""
        self.cache, self.length, self.banned = cache, cache.get_seq_length(), list(banned)
        self.rewind(length)

    @torch.no_grad()
    def forward(self, ids: list[int] | torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `ids`; returns float32 logits `[n, vocab]` (`[1, vocab]`, the last one's, with `last_only`) and
        target-layer states `[n, layers*hidden]`."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        last = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **last)
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
