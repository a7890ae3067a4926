"""A DSpark or DFlash checkpoint proposing draft blocks from the verifier's captured states, as vLLM serves it.

One proposal, anchored at position p (the token the verifier sampled last, whose own hidden
state is not known yet):

- context: `hidden_norm(fc(states))` of the verifier's target-layer states at positions 0..p-1,
  injected as keys/values into every draft layer. As vLLM does, each layer's context keys (after
  its k_norm and RoPE) and values are kept per request in a `DraftContext` and extended by the
  tokens accepted at each step, so a proposal projects only its own block, never the context again
  (`kv_cache=False` recomputes them through speculators' own layer forward: the reference);
- block: the anchor's embedding, then mask embeddings, at positions p, p+1, ...; every slot sees
  the whole context and the whole block (no causal mask), as in training;
- logits: the drafter's lm_head over the draft vocabulary, plus the Markov bias of the previous
  token, so the slots are sampled one after the other; draft ids map to verifier ids by d2t.

Two layouts:
- `dspark` (vLLM's DSpark speculator, Model Runner V2): `block_size` slots; with
  `sample_from_anchor` slot k drafts token p+k+1, so the anchor slot drafts the first token;
  without it slot 0 is the anchor only and slots 1..block_size-1 draft p+1...
- `dflash-v1` (vLLM's V1 DFlash proposer, `method: dflash`): 1+N slots, slots 1..N sampled as
  tokens p+1..p+N, no Markov bias and no confidence head, whatever the checkpoint says. On a
  checkpoint trained with `sample_from_anchor` every draft is then the drafter's guess for the
  token one further on: this layout reproduces that, to predict what vLLM V1 will accept.
"""

from __future__ import annotations

import torch

from dspark.decode.config import Layout, SamplingConfig
from dspark.decode.proposal import Proposal, sample_draft
from dspark.kinds import DSPARK_LAYOUT, kind_of
from dspark.train.blocks import slot_bias


class DraftContext:
    """One request's context in the drafter: positions 0..length-1, the verified tokens.

    Per draft layer, the keys and values the layer attends to (`[1, kv_heads, capacity, head_dim]`,
    keys after k_norm and RoPE); the slots past `length` are scratch the next block writes its own
    keys and values into. `rewind` forgets the tail, as the verifier's cache does: a prompt's
    context is computed once and rewound to it for each decode of that prompt.
    Uncached (`kv_cache=False`): `hidden` holds the fc outputs instead, `[length, hidden]`.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], hidden: torch.Tensor | None = None):
        self.keys, self.values, self.hidden, self.length = keys, values, hidden, 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, n: int) -> None:
        """Room for `n` positions in all; doubling, so a request copies its context a few times at most."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for kv in (self.keys, self.values):
            for i, t in enumerate(kv):
                grown = t.new_empty(*t.shape[:2], cap, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                kv[i] = grown

    def rewind(self, length: int) -> None:
        """Keep the first `length` positions."""
        self.length = min(length, self.length)
        if self.hidden is not None:
            self.hidden = self.hidden[:length]


class Drafter:
    def __init__(self, model, layout: Layout, num_speculative_tokens: int | None = None, kv_cache: bool = True):
        """`num_speculative_tokens`: dflash-v1 only (the dspark layout drafts what the checkpoint was trained to).

        `kv_cache=False` recomputes every layer's context keys and values at every proposal, through
        speculators' layer forward (slower; the reference the cached path is tested against).
        """
        self.model = model
        self.layout = layout
        self.kv_cache = kv_cache
        cfg = model.config
        self.anchor_slot_drafts = bool(cfg.sample_from_anchor) and layout == DSPARK_LAYOUT
        if layout == DSPARK_LAYOUT:
            self.slots = model.block_size
            self.num_speculative_tokens = self.slots - (0 if self.anchor_slot_drafts else 1)
        else:
            # vLLM takes N from the checkpoint's proposal method unless the speculative config sets it
            self.num_speculative_tokens = (num_speculative_tokens or
                                           cfg.speculators_config.proposal_methods[0].speculative_tokens)
            self.slots = 1 + self.num_speculative_tokens
        # a DFlash drafter has neither head; nor do DSpark's serve in vLLM's dflash-v1 layout
        self.markov = getattr(model, "markov_head", None) if layout == DSPARK_LAYOUT else None
        self.confidence = getattr(model, "confidence_head", None) if layout == DSPARK_LAYOUT else None
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def context(self, tokens, states: torch.Tensor) -> DraftContext:
        """A request's context from its prompt: the verifier's states of it, `[n, layers*hidden]` (its tokens
        are not read: a block's context is the states alone)."""
        if not self.kv_cache:
            hidden = self.model.config.transformer_layer_config.hidden_size
            ctx = DraftContext([], [], torch.empty(0, hidden, dtype=self.dtype, device=self.device))
        else:
            attn = self.model.layers[0].self_attn
            shape = (1, attn.k_proj.out_features // attn.head_dim, 0, attn.head_dim)
            empty = lambda: torch.empty(shape, dtype=self.dtype, device=self.device)  # noqa: E731
            n = len(self.model.layers)
            ctx = DraftContext([empty() for _ in range(n)], [empty() for _ in range(n)])
        self.extend(ctx, tokens, states)
        return ctx

    def _hidden(self, states: torch.Tensor) -> torch.Tensor:
        m = self.model
        return m.hidden_norm(m.fc(states.to(self.device, self.dtype)))

    @torch.no_grad()
    def extend(self, ctx: DraftContext, tokens, states: torch.Tensor) -> None:
        """Append the verifier's states of newly verified `tokens`: their keys and values, once, in every layer."""
        from speculators.models.dflash.model_definitions import apply_rotary_pos_emb

        h = self._hidden(states)
        start, n = ctx.length, h.shape[0]
        if not self.kv_cache:
            ctx.hidden = torch.cat([ctx.hidden, h])
            ctx.length += n
            return
        ctx.reserve(start + n + self.slots)  # and the next block's scratch
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(h, positions)
        h = h.unsqueeze(0)
        for i, layer in enumerate(self.model.layers):  # the layer's own projections: not its input_layernorm
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(h).view(1, n, -1, attn.head_dim)).transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            ctx.keys[i][:, :, start:start + n] = k
            ctx.values[i][:, :, start:start + n] = attn.v_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)
        ctx.length = start + n

    @torch.no_grad()
    def _block_hidden(self, ctx: DraftContext, anchor: int) -> torch.Tensor:
        m, p = self.model, ctx.length
        ids = torch.full((1, self.slots), m.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = anchor
        x = m.embed_tokens(ids)
        if not self.kv_cache:  # speculators' layer forward: the context's keys and values projected again
            positions = torch.arange(p + self.slots, device=self.device).unsqueeze(0)
            rope = m.rotary_emb(x, positions)
            for layer in m.layers:  # attention_mask None: the block sees all of the context and itself
                x = layer(hidden_states=x, target_hidden=ctx.hidden.unsqueeze(0), attention_mask=None,
                          position_ids=positions, position_embeddings=rope, use_cache=False)
            return m.norm(x)[0]  # [slots, hidden]
        from speculators.models.dflash.model_definitions import (
            ALL_ATTENTION_FUNCTIONS,
            apply_rotary_pos_emb,
            eager_attention_forward,
        )

        # Qwen3DFlashDecoderLayer.forward with the context's keys and values read from ctx, not recomputed
        S = self.slots
        cos, sin = m.rotary_emb(x, torch.arange(p, p + S, device=self.device).unsqueeze(0))
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            impl = attn.config._attn_implementation
            attn_fn = eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(1, S, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(1, S, -1, attn.head_dim)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = ctx.keys[i], ctx.values[i]
            keys[:, :, p:p + S] = k  # the block's own keys and values, in the scratch past the context
            values[:, :, p:p + S] = attn.v_proj(h).view(1, S, -1, attn.head_dim).transpose(1, 2)
            out, _ = attn_fn(attn, q, keys[:, :, :p + S], values[:, :, :p + S], None, dropout=0.0,
                             scaling=attn.scaling, sliding_window=attn.sliding_window)
            x = x + attn.o_proj(out.reshape(1, S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)[0]  # [slots, hidden]

    @torch.no_grad()
    def propose(self, ctx: DraftContext, anchor: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None, max_drafts: int | None = None) -> Proposal:
        """Draft `num_speculative_tokens` after `anchor`, given the context of the positions before it (a block in
        one forward: `max_drafts` saves nothing, the step verifies fewer).

        At temperature 0 drafts are argmaxes and need no probabilities. Otherwise `sampling.draft_sample`
        says how: `probabilistic` samples each slot at the temperature, and `greedy` (vLLM's default
        `draft_sample_method`) takes the argmax, which rejection sampling then treats as a one-hot
        draft distribution.
        """
        m = self.model
        hidden = self._block_hidden(ctx, anchor)
        logits = m.lm_head(hidden).float()  # [slots, draft vocab]
        first = 0 if self.anchor_slot_drafts else 1
        # prev[k]: the token the Markov bias of slot k conditions on (the one just before what slot k drafts)
        prev = torch.full((self.slots,), anchor, dtype=torch.long, device=self.device)
        tokens, probs, conf = [], [], []
        for k in range(first, self.slots):
            row = logits[k]
            if self.markov is not None:
                row = row + slot_bias(self.markov, prev[None], hidden[None], k)[0].float()
            if self.confidence is not None:
                feats = hidden[k]
                if m.config.confidence_head_with_markov:
                    feats = torch.cat([feats, self.markov.prev_embeddings(prev[k:k + 1])[0].to(feats.dtype)])
                conf.append(torch.sigmoid(self.confidence(feats[None]).float())[0])
            token, p = sample_draft(m, row, sampling.temperature, sampling.draft_sample, generator)
            if p is not None:
                probs.append(p)
            tokens.append(token)
            if k + 1 < self.slots:  # slot k drafted the token right before what slot k+1 drafts
                prev[k + 1] = token
        return Proposal(torch.stack(tokens), torch.stack(probs) if probs else None,
                        torch.stack(conf) if conf else None)


def drafter_for(model, layout: Layout, num_speculative_tokens: int | None = None):
    """The decode loop's drafter for a loaded checkpoint of any kind, as its kind makes it (`layout`: the DFlash
    family's only)."""
    kind = kind_of({"speculators_model_type": model.config.speculators_model_type}, "the drafter's config")
    return kind.drafter(model, layout, num_speculative_tokens)
