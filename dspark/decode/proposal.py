"""What every drafter hands the decode loop (a `Proposal`) and how a draft token is sampled from its logits.

Shared by the DFlash-family drafter (drafter.py), EAGLE-3's (eagle3.py) and prompt lookup (ngram.py):
its own module, so none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.decode.config import DraftSample
from dspark.train.blocks import to_verifier


@dataclass
class Proposal:
    tokens: torch.Tensor              # [N] verifier token ids
    probs: torch.Tensor | None        # [N, verifier vocab] the distributions they were sampled from (probabilistic)
    confidence: torch.Tensor | None   # [N] the confidence head's acceptance probability per drafted token


def sample_draft(model, row: torch.Tensor, temperature: float, sample: DraftSample,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft from a row of draft-vocabulary logits: (its verifier id, the distribution it was drawn from
    in verifier ids, for rejection sampling; None at temperature 0, where drafts are argmaxes)."""
    if temperature > 0 and sample == "probabilistic":
        p = torch.softmax(row / temperature, -1)
        draft = torch.multinomial(p, 1, generator=generator)[0]
    else:
        draft = row.argmax()
        p = torch.nn.functional.one_hot(draft, len(row)).float()
    if temperature == 0:
        return to_verifier(model, draft), None
    if model.d2t is not None:  # scattered into the verifier's vocabulary
        p = torch.zeros(model.verifier_vocab_size, dtype=p.dtype, device=p.device).index_add_(
            0, to_verifier(model, torch.arange(len(p), device=p.device)), p)
    return to_verifier(model, draft), p
