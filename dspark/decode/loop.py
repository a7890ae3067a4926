"""Speculative decoding, one request at a time: the drafter proposes, one verifier forward checks.

Verification follows vLLM's rejection sampler (v1/worker/gpu/spec_decode/rejection_sampler_utils.py):
- greedy (temperature 0): a draft is accepted while it equals the verifier's argmax; the first
  mismatch is replaced by that argmax, so the output is the verifier's own greedy output;
- `standard` (Leviathan et al.): draft i is accepted while p_i(x) > u * q_i(x); a rejected one
  is resampled from max(p_i - q_i, 0);
- `block` (Sun et al. 2024, vLLM's `rejection_sample_method: block`): the longest prefix whose
  block-level test passes is accepted (a later position can pass after an earlier one failed),
  the next token comes from max(c_tau * p_tau - q_tau, 0) with c the capped running ratio p/q.
All three sample exactly from the verifier's distribution; they differ in how much they accept.

A prompt's forward is done once (`prefill`) and shared by every decode of that prompt: each
cuts the verifier's cache and the drafter's context back to the prompt and goes on from there.
Its measured time is charged to each of them (`prefill_s`, inside `seconds`), so every run's
timings, and the speedup between two runs, read as if each had done its own prompt forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.decode.config import Rejection, SamplingConfig
from dspark.decode.cost import VerifyAll
from dspark.decode.drafter import DraftContext, Drafter
from dspark.decode.proposal import Proposal
from dspark.decode.verifier import Verifier


@dataclass
class Trace:
    """One request: its output, and per verifier step how many drafts were verified and accepted."""

    tokens: list[int]
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidence: list[list[float]] = field(default_factory=list)  # per step, the confidence head's (if it has one)
    draft_s: float = 0.0    # drafter: proposals and the context it keeps
    verify_s: float = 0.0   # verifier forwards after the prompt's
    prefill_s: float = 0.0  # the verifier's forward over the prompt (shared: see the module docstring)
    seconds: float = 0.0


@dataclass
class Prefill:
    """A prompt's forward, shared by every decode of that prompt.

    The verifier's cache and the drafter's context are kept as the forward left them; a decode
    cuts both back to `length` (later tokens are written past it, the prompt's are never touched).
    """

    length: int
    logits: torch.Tensor             # [vocab] the verifier's next-token logits after the prompt
    cache: object                    # the verifier's KV cache
    banned: list[int]
    seconds: float                   # the verifier's forward
    context: DraftContext | None = None  # the drafter's context of the prompt (None for the verifier alone)
    draft_s: float = 0.0             # computing it


def prefill_each(verifier: Verifier, drafters: list, prompt: list[int], banned: set[int] = frozenset()) -> list[Prefill]:
    """The prompt's forward (last logits only), once, and each drafter's context of it (None: the verifier alone).

    The prefills share the verifier's cache, each decode cutting it back to the prompt. `banned`: see Verifier.reset.
    """
    start = time.perf_counter()
    verifier.reset(banned)
    logits, states = verifier.forward(prompt, last_only=True)
    forward_s, out = time.perf_counter() - start, []
    for drafter in drafters:
        t = time.perf_counter()
        context = None if drafter is None else drafter.context(prompt, states)
        out.append(Prefill(verifier.length, logits[-1], verifier.cache, verifier.banned, forward_s, context,
                           time.perf_counter() - t))
    return out


def prefill(verifier: Verifier, drafter: Drafter | None, prompt: list[int], banned: set[int] = frozenset()) -> Prefill:
    """The prompt's forward (last logits only) and, with a drafter, its context."""
    return prefill_each(verifier, [drafter], prompt, banned)[0]


def _start(verifier: Verifier, drafter, prompt: list[int], banned: set[int], pre: Prefill | None) -> Prefill:
    """This decode's prefill: `pre` cut back to the prompt, or a new one."""
    if pre is None:
        return prefill(verifier, drafter, prompt, banned)
    if pre.length != len(prompt) or sorted(banned) != pre.banned or (drafter is not None and pre.context is None):
        raise ValueError("this prefill is of another prompt or request")
    verifier.resume(pre.cache, pre.length, pre.banned)
    if drafter is not None:
        pre.context.rewind(pre.length)
    return pre


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, -1)


def _sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen)[0])


def _resample(residual: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> int:
    """A rejected position's token from the residual mass; p itself when rounding left none (p == q)."""
    residual = torch.clamp(residual, min=0)
    return _sample(residual if float(residual.sum()) > 0 else p, gen)


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen))


def accept(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, temperature: float,
           method: Rejection, gen: torch.Generator | None = None) -> tuple[int, int]:
    """(accepted drafts, next token) for verifier `logits` [n+1, V] over the anchor and the n drafts."""
    n = len(drafts)
    if temperature == 0:
        target = logits.argmax(-1)
        hit = (drafts == target[:n]).long().cumprod(0)
        a = int(hit.sum())
        return a, int(target[a])
    p = _probs(logits, temperature)
    q = draft_probs
    if method == "standard":
        for i in range(n):
            d = int(drafts[i])
            if not p[i, d] > _uniform(gen) * q[i, d]:
                return i, _resample(p[i] - q[i], p[i], gen)
        return n, _sample(p[n], gen)
    # block verification: c_i = min(1, c_{i-1} p_i(d_i) / q_i(d_i)), and position i passes with
    # probability h_i, the mass the next position could still repair over what rejecting costs.
    a, c, cs = 0, 1.0, []
    for i in range(n):
        d = int(drafts[i])
        c = min(1.0, c * float(p[i, d]) / max(float(q[i, d]), 1e-30))
        cs.append(c)
        if i < n - 1:
            residual = float(torch.clamp(c * p[i + 1] - q[i + 1], min=0).sum())
            denom = residual + 1.0 - c
            h = residual / denom if denom > 0 else 1.0
        else:
            h = c
        if _uniform(gen) <= h:
            a = i + 1
    if a == n:
        return a, _sample(p[n], gen)
    c_prev = cs[a - 1] if a > 0 else 1.0
    return a, _resample(c_prev * p[a] - q[a], p[a], gen)


def _first_token(logits: torch.Tensor, temperature: float, gen) -> int:
    return int(logits.argmax()) if temperature == 0 else _sample(_probs(logits, temperature), gen)


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def speculative(verifier: Verifier, drafter: Drafter, prompt: list[int], max_new: int, *, sampling: SamplingConfig,
                eos: set[int] = frozenset(), verify=None, gen: torch.Generator | None = None,
                prefilled: Prefill | None = None) -> Trace:
    """Decode up to `max_new` tokens of `prompt` as `sampling` says (its temperature, draft_sample, rejection and
    ignore_eos; the count is the caller's: a warm-up decodes a few). `verify`: how many of a proposal's drafts
    a step verifies (decode/cost.py's policies; None: all of them). `prefilled`: this prompt's
    `prefill(verifier, drafter, ...)`, reused instead of another."""
    temperature = sampling.temperature
    # vLLM's ignore_eos: stop tokens are never sampled
    pre = _start(verifier, drafter, prompt, eos if sampling.ignore_eos else set(), prefilled)
    start = time.perf_counter()  # the decode after the prompt's forward; that forward is charged as measured
    ctx = pre.context
    trace = Trace([_first_token(pre.logits, temperature, gen)])
    trace.prefill_s, trace.draft_s = pre.seconds, pre.draft_s
    done = trace.tokens[0] in eos
    verify = verify or VerifyAll()
    verify.reset()
    while len(trace.tokens) < max_new and not done:
        anchor = trace.tokens[-1]
        t = time.perf_counter()
        most = verify.plan(verifier.length)
        if most == 0:  # no proposal this step: the verifier's token alone
            prop, n = Proposal(torch.zeros(0, dtype=torch.long), None, None), 0
        else:
            prop = drafter.propose(ctx, anchor, sampling, gen, max_drafts=most)
            n = verify(prop, verifier.length)
        if drafter.confidence is not None:  # per step, [] where nothing was proposed
            trace.confidence.append([] if prop.confidence is None else prop.confidence.tolist())
        drafts = prop.tokens[:n]
        t1 = time.perf_counter()
        base = verifier.length
        logits, states = verifier.forward(torch.cat([torch.tensor([anchor]), drafts.cpu()]))
        probs = None if prop.probs is None else prop.probs[:n].to(logits.device)
        a, nxt = accept(logits, drafts.to(logits.device), probs, temperature, sampling.rejection, gen)
        verifier.rewind(base + 1 + a)  # the anchor and the accepted drafts are now verified context
        t2 = time.perf_counter()
        drafter.extend(ctx, [anchor, *drafts[:a].tolist()], states[: 1 + a])
        step = [*drafts[:a].tolist(), nxt]
        trace.tokens += step
        done = not eos.isdisjoint(step)  # a stop token among the accepted drafts ends the request too
        trace.verified.append(n)
        trace.accepted.append(a)
        trace.draft_s += (t1 - t) + (time.perf_counter() - t2)
        trace.verify_s += t2 - t1
    trace.tokens = _finish(trace.tokens, max_new, eos)
    trace.seconds = pre.seconds + pre.draft_s + time.perf_counter() - start
    return trace


def autoregressive(verifier: Verifier, prompt: list[int], max_new: int, *, sampling: SamplingConfig,
                   eos: set[int] = frozenset(), gen: torch.Generator | None = None,
                   prefilled: Prefill | None = None) -> Trace:
    """The verifier decoding alone, one token per forward: the output and speed to compare against (`sampling`:
    its temperature and ignore_eos)."""
    temperature = sampling.temperature
    pre = _start(verifier, None, prompt, eos if sampling.ignore_eos else set(), prefilled)
    start = time.perf_counter()
    tokens = [_first_token(pre.logits, temperature, gen)]
    while len(tokens) < max_new and tokens[-1] not in eos:
        logits, _ = verifier.forward([tokens[-1]])
        tokens.append(_first_token(logits[-1], temperature, gen))
    decode_s = time.perf_counter() - start
    steps = len(tokens) - 1  # forwards after the prompt's, each a step that verified no draft
    return Trace(_finish(tokens, max_new, eos), [0] * steps, [0] * steps, seconds=pre.seconds + decode_s,
                 prefill_s=pre.seconds, verify_s=decode_s)
