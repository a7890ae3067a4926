"""Prompt lookup (vLLM's `method: ngram`): no model, drafts copied from earlier in the request.

The longest suffix of the request's tokens (prompt, output and the anchor) of length between
`prompt_lookup_min` and `prompt_lookup_max` that occurred earlier is looked up; its earliest
occurrence wins, and the up to `num_speculative_tokens` tokens that followed it are the drafts.
That is vLLM's rule (v1/spec_decode/ngram_proposer.py, a KMP over the reversed tokens), written
here as the direct search it is equivalent to. No match: no drafts, and the step is the verifier's
own, as in vLLM, where such a step is not counted as a draft.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.decode.config import PromptLookupConfig, SamplingConfig
from dspark.decode.proposal import Proposal


def lookup(tokens, min_n: int, max_n: int, k: int, max_len: int | None = None) -> list[int]:
    """The drafts prompt lookup proposes after `tokens` (the request so far, anchor included)."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    if max_len is not None:
        k = min(k, max_len - total)  # never draft past the model's length
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = seq[total - n:]
        # every earlier start (it may overlap the suffix itself), earliest first
        windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return seq[start:start + k].tolist()
    return []


class NgramContext:
    """A request's tokens so far; rewound as the verifier's cache is."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rewind(self, length: int) -> None:
        del self.tokens[length:]


class NgramDrafter:
    """The decode loop's drafter interface (see decode/drafter.py's Drafter) over prompt lookup."""

    confidence = None

    def __init__(self, vocab_size: int, num_speculative_tokens: int, lookup: PromptLookupConfig,
                 max_len: int | None = None):
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.slots = 1 + num_speculative_tokens  # the anchor and its drafts: the room a step needs
        self.min_n, self.max_n, self.max_len = lookup.prompt_lookup_min, lookup.prompt_lookup_max, max_len

    def context(self, tokens, states=None) -> NgramContext:
        return NgramContext(list(tokens))

    def extend(self, ctx: NgramContext, tokens, states=None) -> None:
        ctx.tokens += list(tokens)

    def propose(self, ctx: NgramContext, anchor: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_drafts: int | None = None) -> Proposal:
        k = self.num_speculative_tokens if max_drafts is None else min(max_drafts, self.num_speculative_tokens)
        drafts = torch.tensor(lookup([*ctx.tokens, anchor], self.min_n, self.max_n, k, self.max_len),
                              dtype=torch.long)
        # vLLM verifies n-gram drafts as one-hot draft distributions (it has no probabilities for them)
        probs = torch.nn.functional.one_hot(drafts, self.vocab_size).float() if sampling.temperature > 0 else None
        return Proposal(drafts, probs, None)
