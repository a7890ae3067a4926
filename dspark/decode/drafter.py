"""A dspark checkpoint proposing draft blocks from the verifier's captured states, as vLLM serves it.

One proposal, anchored at position p (the token the verifier sampled last, whose own hidden
state is not known yet):

- context: `hidden_norm(fc(states))` of the verifier's target-layer states at positions 0..p-1,
  injected as keys/values into every draft layer (kept per request, extended as tokens are accepted);
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

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["dspark", "dflash-v1"]
DraftSample = Literal["probabilistic", "greedy"]


@dataclass
class Proposal:
    tokens: torch.Tensor              # [N] verifier token ids
    probs: torch.Tensor | None        # [N, verifier vocab] the distributions they were sampled from (probabilistic)
    confidence: torch.Tensor | None   # [N] the confidence head's acceptance probability per drafted token


class Drafter:
    def __init__(self, model, layout: Layout = "dspark", num_speculative_tokens: int | None = None):
        """`num_speculative_tokens`: dflash-v1 only (the dspark layout drafts what the checkpoint was trained to)."""
        self.model = model
        self.layout = layout
        cfg = model.config
        self.anchor_slot_drafts = bool(cfg.sample_from_anchor) and layout == "dspark"
        if layout == "dspark":
            self.slots = model.block_size
            self.num_speculative_tokens = self.slots - (0 if self.anchor_slot_drafts else 1)
        else:
            # vLLM takes N from the checkpoint's proposal method unless the speculative config sets it
            self.num_speculative_tokens = (num_speculative_tokens or
                                           cfg.speculators_config.proposal_methods[0].speculative_tokens)
            self.slots = 1 + self.num_speculative_tokens
        self.markov = model.markov_head if layout == "dspark" else None
        self.confidence = model.confidence_head if layout == "dspark" else None
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def context(self, states: torch.Tensor) -> torch.Tensor:
        """The drafter's view of verifier states `[n, layers*hidden]`: computed once per token, then kept."""
        m = self.model
        return m.hidden_norm(m.fc(states.to(self.device, self.dtype)))

    def _to_verifier(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t = self.model.d2t
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]

    @torch.no_grad()
    def _block_hidden(self, ctx: torch.Tensor, anchor: int) -> torch.Tensor:
        m, p = self.model, ctx.shape[0]
        ids = torch.full((1, self.slots), m.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = anchor
        x = m.embed_tokens(ids)
        positions = torch.arange(p + self.slots, device=self.device).unsqueeze(0)
        rope = m.rotary_emb(x, positions)
        for layer in m.layers:  # attention_mask None: the block sees all of the context and itself
            x = layer(hidden_states=x, target_hidden=ctx.unsqueeze(0), attention_mask=None,
                      position_ids=positions, position_embeddings=rope, use_cache=False)
        return m.norm(x)[0]  # [slots, hidden]

    @torch.no_grad()
    def propose(self, ctx: torch.Tensor, anchor: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, sample: DraftSample = "probabilistic") -> Proposal:
        """Draft `num_speculative_tokens` after `anchor`, given the context of the positions before it.

        At temperature 0 drafts are argmaxes and need no probabilities. Otherwise `probabilistic`
        samples each slot at the temperature, and `greedy` (vLLM's default `draft_sample_method`)
        takes the argmax, which rejection sampling then treats as a one-hot draft distribution.
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
                row = row + self._markov_bias(prev, hidden, k)
            if self.confidence is not None:
                feats = hidden[k]
                if m.config.confidence_head_with_markov:
                    feats = torch.cat([feats, self.markov.prev_embeddings(prev[k:k + 1])[0].to(feats.dtype)])
                conf.append(torch.sigmoid(self.confidence(feats[None]).float())[0])
            if temperature > 0 and sample == "probabilistic":
                p = torch.softmax(row / temperature, -1)
                draft = torch.multinomial(p, 1, generator=generator)[0]
            else:
                draft = row.argmax()
                p = torch.nn.functional.one_hot(draft, len(row)).float()
            if temperature > 0:
                probs.append(self._scatter(p))
            token = self._to_verifier(draft)
            tokens.append(token)
            if k + 1 < self.slots:  # slot k drafted the token right before what slot k+1 drafts
                prev[k + 1] = token
        return Proposal(torch.stack(tokens), torch.stack(probs) if probs else None,
                        torch.stack(conf) if conf else None)

    def _markov_bias(self, prev: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        if self.markov.head_type == "vanilla":  # W2 W1[prev]: this slot's previous token only
            return self.markov.markov_w2(self.markov.prev_embeddings(prev[k:k + 1]))[0].float()
        # gated and rnn read the slot's hidden state, rnn every earlier slot too: the block's bias
        return self.markov.block_bias(prev_token_ids=prev[None], hidden_states=hidden[None])[0, k].float()

    def _scatter(self, p: torch.Tensor) -> torch.Tensor:
        """A draft-vocabulary distribution in verifier ids (rejection sampling compares it with the verifier's)."""
        d2t = self.model.d2t
        if d2t is None:
            return p
        out = torch.zeros(self.model.verifier_vocab_size, dtype=p.dtype, device=p.device)
        ids = torch.arange(len(p), device=p.device)
        return out.index_add_(0, self._to_verifier(ids), p)
