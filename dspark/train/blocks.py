"""A drafter's blocks scored as decoding takes them, and how much of that it owes to the verifier's states.

Drafts are chained: speculators' training forward feeds the Markov head the data's own previous
token (teacher forcing), so scoring those logits measures "the next token given the true current
one" at every position past the first. A decoder has only its own drafts: here slot k's bias comes
from slot k-1's argmax, as in the decode loop (which calls `slot_bias` one slot at a time) and vLLM.

State gain: the same blocks (same anchors) are scored with the real context states, with them
zeroed, and with another sample's states laid position by position (the attention sink and the
massive channels stay where real states have them). The gain per position is the real rate minus
the better control: a drafter that ignores its context (dead, misaligned or wrong-norm states, the
failures users report most) shows none, however good its loss looks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

CONTROLS = ("zeroed", "other_sample")  # the context states a drafter is scored with beside the real ones


def to_verifier(model, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids as verifier ids: speculators' d2t holds offsets (vLLM adds them the same way)."""
    d2t = model.d2t
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def slot_bias(head, prev: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """The Markov bias of slot k, `[N, draft vocab]`, from the previous tokens `prev [N, B]` of slots 0..k.

    vanilla reads slot k's previous token, gated also its hidden state, rnn every earlier slot.
    """
    if head.head_type == "vanilla":
        return head.markov_w2(head.prev_embeddings(prev[:, k]).to(head.markov_w2.weight.dtype))
    if head.head_type == "gated":
        return head.block_bias(prev_token_ids=prev[:, k:k + 1], hidden_states=hidden[:, k:k + 1])[:, 0]
    return head.block_bias(prev_token_ids=prev[:, :k + 1], hidden_states=hidden[:, :k + 1])[:, k]


def chained_logits(model, hidden: torch.Tensor, logits: torch.Tensor,
                   block_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float logits `[N, B, V]` with each slot's Markov bias from the slot before's argmax, the previous tokens used).

    `block_tokens [N, B]`: the data's tokens at the blocks' positions (slot 0 the anchor); only the anchor is read.
    """
    N, B = block_tokens.shape
    logits = logits.reshape(N, B, -1).float()
    head = getattr(model, "markov_head", None)
    if head is None:  # DFlash: slots are independent
        return logits, block_tokens
    hidden = hidden.reshape(N, B, -1)
    # slot k's previous token: with sample_from_anchor slot k drafts p+k+1 after p+k (slot 0: the anchor);
    # without it slot 0 drafts nothing and slot 1 follows the anchor
    first = 0 if model.config.sample_from_anchor else 1
    prev = block_tokens[:, :1].expand(N, B).clone()
    out = logits.clone()
    for k in range(first, B):
        out[:, k] += slot_bias(head, prev, hidden, k).float()
        if k + 1 < B:
            prev[:, k + 1] = to_verifier(model, out[:, k].argmax(-1))
    return out, prev


@dataclass
class Blocks:
    """Scored blocks, one row each, `[N, B]` per slot (N: the valid anchors of a batch)."""

    match: np.ndarray            # greedy: the chained draft's argmax is the verifier's
    accept: np.ndarray           # 1 - TV(draft, verifier): what rejection sampling accepts
    mask: np.ndarray             # supervised slots
    confidence: np.ndarray | None
    drafts: np.ndarray           # the chained argmax drafts, verifier ids
    anchors: np.ndarray          # [N] positions in the packed batch

    @classmethod
    def concat(cls, blocks: list[Blocks]) -> Blocks:
        """The rows of several batches' blocks, in order."""
        cat = lambda f: np.concatenate([getattr(b, f) for b in blocks])  # noqa: E731
        confidence = None if blocks[0].confidence is None else cat("confidence")
        return cls(cat("match"), cat("accept"), cat("mask"), confidence, cat("drafts"), cat("anchors"))

    def drop_first_slot(self) -> Blocks:
        """Without sample_from_anchor slot 0 holds the anchor and drafts nothing: position 1 is slot 1."""
        return Blocks(self.match[:, 1:], self.accept[:, 1:], self.mask[:, 1:],
                      None if self.confidence is None else self.confidence[:, 1:], self.drafts[:, 1:], self.anchors)


def anchor_bucket(anchors: int) -> int:
    """The anchor count a forward is run with: the next power of two, so that a compiled forward (CUDA) sees a
    handful of shapes over an eval whose batches each score a different count, not one recompile per batch."""
    return 1 << max(anchors - 1, 0).bit_length()


def score(model, inputs: dict[str, torch.Tensor], anchors: int, seed: int) -> Blocks:
    """Score `anchors` blocks of a packed batch (on the model's device), drawn with `seed`: the same seed draws
    the same anchors whatever the states, so controls score the blocks the real states did."""
    from speculators.models.dflash.utils import select_anchors

    device = inputs["input_ids"].device
    B, n = model.block_size, anchor_bucket(anchors)
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with torch.no_grad(), rng:
        # the forward's first draw from the generator is its select_anchors: made here too, under the same seed,
        # it names the anchors the forward takes
        torch.manual_seed(seed)
        positions, valid = select_anchors(inputs["loss_mask"], n, B)
        torch.manual_seed(seed)
        hidden, logits, targets, mask, idx = model._backbone_forward(
            **{k: inputs[k] for k in ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
                                      "document_ids", "position_ids")}, max_anchors=n)
        logits, prev = chained_logits(model, hidden, logits, inputs["input_ids"][0, idx].view(-1, B))
        targets = targets[0].float().view(-1, B, targets.shape[-1])
        tv = 0.5 * (logits.softmax(-1) - targets.softmax(-1)).abs().sum(-1)
        drafts = logits.argmax(-1)
        confidence = None
        if getattr(model, "confidence_head", None) is not None:
            h = hidden.reshape(-1, B, hidden.shape[-1])
            feats = h
            if model.config.confidence_head_with_markov:
                feats = torch.cat([h, model.markov_head.prev_embeddings(prev).to(h.dtype)], dim=-1)
            confidence = model.confidence_head(feats).float().sigmoid()
    keep = np.flatnonzero(valid.cpu().numpy())
    if len(keep) > anchors:  # a uniform subset of the bucket's uniform draw: a uniform draw of `anchors`
        keep = np.sort(np.random.default_rng(seed).choice(keep, anchors, replace=False))
    rows = lambda t: t.cpu().numpy()[keep]  # noqa: E731
    blocks = Blocks(rows(drafts == targets.argmax(-1)), rows(1 - tv), rows(mask[0].view(-1, B)).astype(bool),
                    None if confidence is None else rows(confidence), rows(to_verifier(model, drafts)),
                    rows(positions))
    return blocks if model.config.sample_from_anchor else blocks.drop_first_slot()


# --- the controls -----------------------------------------------------------------------------------------

def documents(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The context states of each document of a packed batch, `[n, layers*hidden]`, in order."""
    docs = batch["document_ids"][0]
    return [batch["hidden_states"][0, docs == d] for d in torch.unique_consecutive(docs) if d >= 0]


def with_donors(batches: Iterable[dict | None]) -> Iterator[tuple[int, dict, list[torch.Tensor] | None]]:
    """(index, batch, donor documents) for each batch that is not None: another sample's states to score it with.

    A batch's donors are the documents of the batch before it (the first batch's: the last batch's), so every
    document is paired with one it does not contain. A lone batch rotates its own documents; a lone batch
    of one document has no other sample (None).
    """
    first = prev = None
    for i, batch in enumerate(batches):
        if batch is None:
            continue
        if first is None:
            first = (i, batch)  # scored at the end, with the last batch's documents
        else:
            yield i, batch, documents(prev)
        prev = batch
    if first is None:
        return
    i, batch = first
    own = documents(batch)
    if prev is not batch:
        yield i, batch, documents(prev)
    else:
        yield i, batch, own[1:] + own[:1] if len(own) > 1 else None


def control_states(batch: dict[str, torch.Tensor], control: str,
                   donors: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The batch's context states replaced as `control` says (None: that control cannot be formed here)."""
    h = batch["hidden_states"]
    if control == "zeroed":
        return torch.zeros_like(h)
    if donors is None:
        return None
    out = torch.zeros_like(h)
    docs, pos = batch["document_ids"][0], batch["position_ids"][0]
    for n, d in enumerate(d for d in torch.unique_consecutive(docs) if d >= 0):
        donor, sel = donors[n % len(donors)], docs == d
        out[0, sel] = donor[pos[sel] % len(donor)]  # position by position; a shorter donor repeats
    return out


def score_with_controls(model, batch: dict[str, torch.Tensor], donors, place, anchors: int,
                        seed: int) -> dict[str, Blocks | None]:
    """The batch's blocks scored with the real states and each control (`place`: a batch onto the model's device)."""
    out = {"real": score(model, place(batch), anchors, seed)}
    for control in CONTROLS:
        states = control_states(batch, control, donors)
        out[control] = None if states is None else score(model, place({**batch, "hidden_states": states}), anchors,
                                                         seed)
    return out


def tau(rate: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per block: 1 + sum_k prod_{j<=k} rate_j (the bonus token always counts)."""
    return 1 + np.cumprod(np.where(mask, rate, 0.0), axis=1).sum(1)


def sums(scored: dict[str, Blocks | None]) -> dict[str, float]:
    """`*_sum` / `*_total` pairs of one batch (they add over batches and ranks; `metrics.reduce` divides):
    each variant's greedy match per position and tau. A control not formed adds zeros (every rank sends the
    same keys to the all-reduce)."""
    slots = scored["real"].mask.shape[1]
    out: dict[str, float] = {}
    for name, b in scored.items():
        for k in range(slots):
            out[f"{name}_pos{k + 1}_match_sum"] = 0.0 if b is None else float((b.match[:, k] & b.mask[:, k]).sum())
            out[f"{name}_pos{k + 1}_match_total"] = 0.0 if b is None else float(b.mask[:, k].sum())
        out[f"{name}_tau_sum"] = 0.0 if b is None else float(tau(b.match, b.mask).sum())
        out[f"{name}_tau_total"] = 0.0 if b is None else float(len(b.mask))
    return out


def state_gain(rates: dict[str, float]) -> dict[str, float]:
    """`state_gain_X`: the real rate X minus the better control's, for each X of `sums` (after `metrics.reduce`)."""
    out = {}
    for key in [k[len("real_"):] for k in rates if k.startswith("real_")]:
        controls = [rates[f"{c}_{key}"] for c in CONTROLS if f"{c}_{key}" in rates]
        if controls:
            out[f"state_gain_{key}"] = rates[f"real_{key}"] - max(controls)
    return out
