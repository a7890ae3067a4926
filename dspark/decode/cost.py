"""What a verifier step costs on this machine, and how many drafts are worth verifying.

A step verifies the anchor and k drafts in one forward. Whether checking one more draft pays depends
on two things: the chance it is accepted (with all before it) and what the longer check costs. vLLM's
adaptive verification (PR 47808, `enable_adaptive_verification`, DSpark only) profiles the step's
cost at start-up and admits draft slots by the confidence head's running product of confidences.
This is the same rule for one request at a time, with the costs measured here, before decoding:

- `CostProfile`: the verifier's time for a forward over k tokens (k = 1 .. block + 1) at the context
  lengths the prompts decode at, and each drafter's time per proposal (of k drafts where drafting
  costs more for more, as EAGLE-3's one-after-the-other; one figure for a block drafter).
- The expected rate of verifying k drafts is (1 + s_1 + ... + s_k) / (draft + check(k + 1)), s_i the
  chance the first i drafts are all accepted. The policy verifies the k that maximises it, taken over
  every k (the check's cost is a staircase, not smooth).
- `CostDriven`: DSpark, per step, s_i the running product of the confidence head's outputs; after a proposal
  that would not have paid, the next ones are skipped for a while (a proposal is not free on a CPU).
- `best_fixed_k`: drafters without a confidence head (DFlash, EAGLE-3, prompt lookup): s_i measured on a
  calibration set (the validation split, never a reported set), one k for every step. k = 0 is the
  verifier alone, which pays no drafting.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from dspark.decode.proposal import Proposal


@dataclass
class CostProfile:
    """Measured milliseconds: `check_ms[c][k-1]` a verifier forward over k tokens on `contexts[c]` tokens of
    context; `draft_ms[name][k-1]` a proposal of k drafts (one entry: the same for every k)."""

    contexts: list[int]
    check_ms: list[list[float]]
    draft_ms: dict[str, list[float]] = field(default_factory=dict)
    repeats: int = 0
    seconds: float = 0.0  # the profiling's own wall time

    @property
    def max_check(self) -> int:
        return len(self.check_ms[0])

    def check(self, tokens: int, context: int) -> float:
        """A forward over `tokens` tokens after `context` tokens: linear between the profiled contexts, the
        nearest one's beyond them."""
        column = [row[tokens - 1] for row in self.check_ms]
        return float(np.interp(context, self.contexts, column))

    def draft(self, name: str, k: int) -> float:
        """A proposal of `k` drafts by drafter `name` (0: none made)."""
        if k == 0:
            return 0.0
        ms = self.draft_ms[name]
        return ms[min(k, len(ms)) - 1]

    def to_dict(self) -> dict:
        return asdict(self)


def expected_rates(reach, draft_ms: float | list[float], check_ms: list[float]) -> np.ndarray:
    """Expected tokens per millisecond for verifying k = 0..len(reach) drafts: `reach[i-1]` the chance the first i
    are all accepted, `check_ms[k]` the forward over k + 1 tokens. `draft_ms`: a number is a proposal already
    made, paid whatever k (k = 0 included); a list is the cost of proposing k drafts at index k - 1, where k = 0
    proposes nothing and pays nothing (the verifier alone)."""
    reach = np.asarray(reach, dtype=np.float64)
    n = len(reach)
    tokens = 1.0 + np.concatenate([[0.0], np.cumsum(reach)])
    draft = np.asarray([draft_ms] * (n + 1) if np.isscalar(draft_ms) else [0.0, *draft_ms[:n]], dtype=np.float64)
    return tokens / (draft + np.asarray(check_ms[: n + 1], dtype=np.float64))


def best_k(reach, draft_ms, check_ms) -> int:
    """The k of `expected_rates` with the highest rate (the fewest drafts among equals)."""
    return int(np.argmax(expected_rates(reach, draft_ms, check_ms)))


def best_fixed_k(reach, profile: CostProfile, name: str, context: int) -> int:
    """One k for every step of drafter `name`, from its per-position reach measured elsewhere; 0 (the verifier
    alone, no proposal made) where no k >= 1 beats a forward of one token."""
    n = min(len(reach), profile.max_check - 1)
    draft = [profile.draft(name, k) for k in range(1, n + 1)]
    checks = [profile.check(k + 1, context) for k in range(n + 1)]
    return best_k(reach[:n], draft, checks)


class Policy:
    """How many drafts a step verifies. Per step the loop asks `plan` how many to draft at most (0: none, the
    verifier's token alone; None: the drafter's block), then calls the policy on the proposal for the count to
    verify. `reset` starts a request."""

    label = ""
    max_drafts: int | None = None

    def reset(self) -> None:
        pass

    def plan(self, context: int) -> int | None:
        return self.max_drafts

    def __call__(self, prop: Proposal, context: int) -> int:
        return len(prop.tokens)


class VerifyAll(Policy):
    """Every draft of every proposal (fixed N): what the drafter was trained to draft."""

    label = "fixed N"


@dataclass
class FixedK(Policy):
    """The first k drafts of every proposal; a drafter that drafts one after the other makes only k."""

    k: int
    label = "best fixed k"

    @property
    def max_drafts(self) -> int:
        return self.k

    def __call__(self, prop: Proposal, context: int) -> int:
        return min(self.k, len(prop.tokens))


@dataclass
class ConfidenceCut(Policy):
    """The prefix whose running product of confidences stays at or above `threshold`."""

    threshold: float
    label = "confidence cut"

    def __call__(self, prop: Proposal, context: int) -> int:
        return int((prop.confidence.double().cumprod(0) >= self.threshold).sum())


MAX_BACKOFF = 16  # steps without a proposal, at most, before the drafter looks again


@dataclass
class CostDriven(Policy):
    """Per step, the k that maximises the expected rate, the survival of each draft the running product of the
    confidence head's outputs (vLLM's rule), the costs those of `profile` for drafter `name`.

    On a GPU a proposal costs little beside a check; here it costs a fifth of one. So, beyond vLLM's rule, a step
    also skips the proposal where the last one would not have paid for itself (its best expected rate below the
    verifier's alone): the next 1, 2, 4, ... (at most `MAX_BACKOFF`) steps are the verifier's alone, doubling
    while proposals keep not paying, and back to every step once one does.
    """

    profile: CostProfile
    name: str
    label = "cost-driven"
    backoff: int = 0  # steps to skip after the next proposal that does not pay
    skip: int = 0     # steps still to skip

    def reset(self) -> None:
        self.backoff = self.skip = 0

    def plan(self, context: int) -> int | None:
        if self.skip:
            self.skip -= 1
            return 0
        return None

    def __call__(self, prop: Proposal, context: int) -> int:
        n = min(len(prop.tokens), self.profile.max_check - 1)
        survival = prop.confidence[:n].double().cumprod(0).numpy()
        checks = [self.profile.check(k + 1, context) for k in range(n + 1)]
        rates = expected_rates(survival, self.profile.draft(self.name, len(prop.tokens)), checks)
        if rates.max() * checks[0] < 1:  # below 1 / check(1): the verifier alone would have been faster
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.skip = self.backoff
        else:
            self.backoff = 0
        return int(np.argmax(rates))


def _timed_ms(fn, device) -> float:
    """`fn`'s wall milliseconds, its device work included (a GPU runs it after the call returns)."""
    import torch

    t = time.perf_counter()
    fn()
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t)


def _median_ms(fn, repeats: int, device) -> float:
    return statistics.median(_timed_ms(fn, device) for _ in range(repeats))


def profile_contexts(lengths: list[int], max_new: int, limit: int | None) -> list[int]:
    """The context lengths to profile for prompts of `lengths` decoding `max_new` tokens: the shortest, the median
    and the longest halfway through its decode (fewer where they coincide)."""
    mids = sorted(length + max_new // 2 for length in lengths)
    picks = sorted({mids[0], mids[len(mids) // 2], mids[-1]})
    return [min(c, limit) for c in picks] if limit else picks


def profile(verifier, drafters: dict[str, object], ids: list[int], contexts: list[int], max_tokens: int,
            repeats: int, sampling) -> CostProfile:
    """Measure the verifier's forward over 1..`max_tokens` tokens at each of `contexts` (tokens from `ids`,
    repeated to length) and each drafter's proposal at the longest, medians of `repeats`.

    The ks are timed in turn within each repeat, ascending then descending, so a machine that slows down or
    speeds up during the profile does not favour a short or a long check.
    """
    import torch

    start = time.perf_counter()
    base = (list(ids) * (max(contexts) // max(len(ids), 1) + 2))[: max(contexts) + max_tokens + 1]
    rows = []
    states = None
    for length in contexts:
        verifier.reset()
        _, states = verifier.forward(base[:length], last_only=True)
        samples: list[list[float]] = [[] for _ in range(max_tokens)]
        for r in range(repeats):
            order = range(1, max_tokens + 1) if r % 2 == 0 else range(max_tokens, 0, -1)
            for k in order:
                chunk = torch.tensor(base[length:length + k])
                samples[k - 1].append(_timed_ms(lambda: verifier.forward(chunk), verifier.device))
                verifier.rewind(length)
        rows.append([statistics.median(s) for s in samples])
    length = contexts[-1]
    draft_ms = {}
    for name, drafter in drafters.items():
        ctx = drafter.context(base[:length], states)
        anchor = base[length]

        def propose(k=None, drafter=drafter, ctx=ctx):
            ctx.rewind(length)
            drafter.propose(ctx, anchor, sampling, max_drafts=k)

        propose()  # first calls (the context's pairs for EAGLE-3, allocations) stay out of the figure
        n = drafter.num_speculative_tokens
        draft_ms[name] = ([_median_ms(lambda k=k: propose(k), repeats, verifier.device) for k in range(1, n + 1)]
                          if getattr(drafter, "sequential", False) else [_median_ms(propose, repeats, verifier.device)])
    return CostProfile(list(contexts), rows, draft_ms, repeats, time.perf_counter() - start)


def calibration(traces, n: int) -> list[dict] | None:
    """The confidence head against what the verifier accepted, per position, over the steps of `traces` that
    verified every draft: predicted survival (the running product, mean over steps) against the share of steps
    that accepted that far, and the head's own output (mean over the steps that reached the position) against
    the share of those that accepted it. None without confidences."""
    conf = [(c, a) for t in traces for c, a, v in zip(t.confidence, t.accepted, t.verified) if c and v == len(c)]
    if not conf:
        return None
    c = np.array([x for x, _ in conf], dtype=np.float64)[:, :n]
    a = np.array([y for _, y in conf], dtype=np.int64)
    survival = np.cumprod(c, axis=1)
    rows = []
    for i in range(c.shape[1]):
        reached = a >= i
        rows.append({"position": i + 1, "steps": int(len(a)),
                     "predicted_survival": float(survival[:, i].mean()),
                     "observed_survival": float((a >= i + 1).mean()),
                     "reached": int(reached.sum()),
                     "predicted_conditional": float(c[reached, i].mean()) if reached.any() else None,
                     "observed_conditional": float((a[reached] >= i + 1).mean()) if reached.any() else None})
    return rows
