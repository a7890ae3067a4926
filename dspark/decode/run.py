"""`dspark eval --decode`: a checkpoint decoding for real, on named prompt sets, against the verifier alone."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

from dspark.decode.config import DecodeConfig
from dspark.core.errors import InputError
from dspark.core.report import EVAL_DIR
from dspark.decode.cost import VerifyAll

FIXED_N = VerifyAll.label  # every draft verified: the decode every report has had
DRAFTER = "drafter"  # the checkpoint's name in the cost profile


def _sampling(cfg: DecodeConfig) -> str:
    if cfg.temperature == 0:
        return "greedy"
    return f"temperature {cfg.temperature}, {cfg.draft_sample} drafts, {cfg.rejection} rejection sampling"


def decode_set(cfg: DecodeConfig, ps, verifier, drafter, eos: set[int], policies: dict, progress: bool) -> dict:
    """One prompt set: each prompt decoded by the verifier alone, speculatively verifying every draft (fixed N),
    and once per `policies` entry (a label -> decode/cost.py policy: fewer drafts verified)."""
    from tqdm import tqdm

    from dspark.decode.cost import calibration
    from dspark.decode.loop import autoregressive, prefill, speculative
    from dspark.data.prompts import context_bucket
    from dspark.decode.report import by_subdomain, summarize

    n_spec = drafter.num_speculative_tokens
    runs: dict[str, list] = defaultdict(list)
    by_sub = defaultdict(list)
    kw = dict(sampling=cfg, eos=eos)
    for i, prompt in enumerate(tqdm(ps.prompts, desc=f"decode {ps.name}", unit="prompt", disable=not progress)):
        ids = list(prompt.ids)
        seeded = lambda: torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)  # noqa: E731
        # the prompt's forward once for every decode; each is charged its measured time (loop.py)
        pre = prefill(verifier, drafter, ids, eos if cfg.ignore_eos else set())
        runs[FIXED_N].append(speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(), prefilled=pre,
                                         **kw))
        alone = autoregressive(verifier, ids, cfg.max_new_tokens, gen=seeded(), prefilled=pre, **kw)
        runs["verifier_only"].append(alone)
        for label, policy in policies.items():
            if policy.max_drafts == 0:  # no draft pays: the verifier alone
                runs[label].append(alone)
                continue
            runs[label].append(speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(), verify=policy,
                                           prefilled=pre, **kw))
        by_sub[(prompt.subdomain, context_bucket(prompt.length))].append(runs[FIXED_N][-1])
    entry = {**ps.summary(), "by_bucket": {}, "by_subdomain": {}, "too_long": dict(ps.too_long) if ps.longbench else {}}
    if not runs[FIXED_N]:  # a LongBench set entirely beyond the verifier's length: only its buckets report
        return entry
    decoded = summarize(runs[FIXED_N], n_spec)
    alone = runs["verifier_only"]
    base_tokens, base_s = sum(len(t.tokens) for t in alone), sum(t.seconds for t in alone)
    base_rate = base_tokens / base_s
    per_token = 1000 * sum(t.verify_s for t in alone) / max(base_tokens - len(alone), 1)  # after the prompt's
    entry.update(decoded=decoded, speedup=decoded["tokens_per_s"] / base_rate,
                 verifier_only={"tokens": base_tokens, "seconds": base_s, "tokens_per_s": base_rate,
                                "ms_per_token": per_token})
    entry["verification"] = {label: verification_row(summarize(runs[label], n_spec), base_rate)
                             for label in [FIXED_N, *policies]}
    if ps.longbench:
        entry["by_bucket"] = {k: summarize(v, n_spec) for k, v in by_sub.items()}
    if any(sub is not None for sub, _ in by_sub):  # MT-bench categories, LongBench datasets: first-seen order
        entry["by_subdomain"] = by_subdomain([(sub, t) for (sub, _), ts in by_sub.items() for t in ts], n_spec)
    if cfg.temperature == 0:  # greedy speculative decoding must reproduce the verifier's own output
        entry["outputs_equal_verifier_only"] = sum(a.tokens == b.tokens for a, b in zip(runs[FIXED_N], alone))
        entry["outputs_equal_verifier_only_per_policy"] = {
            label: sum(a.tokens == b.tokens for a, b in zip(runs[label], alone)) for label in policies}
    cal = calibration(runs[FIXED_N], n_spec)
    if cal is not None:
        entry["confidence_calibration"] = cal
    return entry


def verification_row(summary: dict, base_rate: float) -> dict:
    """A decode's summary with what a verification policy is judged by: drafts verified per step, speedup."""
    return {**summary, "verified_per_step": summary["draft_tokens"] / max(summary["drafts"], 1),
            "speedup": summary["tokens_per_s"] / base_rate}


def verification(cfg, verifier, drafters: dict, sets: list, run, tokenizer, eos: set[int], progress: bool,
                 decode) -> tuple[dict, object, dict | None]:
    """The cost model's setup, shared by `eval --decode` and `compare`: (per drafter name its policies beside
    fixed N, label -> policy; the profile; the calibration: the set, each drafter's reach there, its best
    fixed k and the context it was chosen at). Nothing without --cost-model or prompts.

    The calibration prompts are --calibration-prompts, else the validation split of `run`'s prepared data
    (None: no best fixed k), decoded verifying every draft by `decode(ps) -> {name: traces}`.
    """
    from dspark.data.prompts import load_prompt_set
    from dspark.decode import cost
    from dspark.decode.report import reach_rates
    from dspark.train.data import split_ids

    v = cfg.verification
    lengths = [p.length for ps in sets for p in ps.prompts]
    policies: dict[str, dict] = {name: {} for name in drafters}
    if not v.cost_model or not lengths:
        return policies, None, None
    room = max(d.slots for d in drafters.values())
    checks = max(d.num_speculative_tokens for d in drafters.values()) + 1  # the anchor and every draft
    first = next(list(ps.prompts[0].ids) for ps in sets if ps.prompts)
    contexts = cost.profile_contexts(lengths, cfg.max_new_tokens, verifier.max_length and verifier.max_length - checks)
    profile = cost.profile(verifier, drafters, first, contexts, checks, v.profile_repeats, cfg)
    chosen = None
    if v.calibration_prompts or run is not None:
        ids = None
        if not v.calibration_prompts:
            from dspark.data.prepare import PreparedData

            ids = split_ids(len(PreparedData(run.data_path)), run.train_data_ratio, run.seed)[1]
        ps = load_prompt_set(v.calibration_prompts or f"validation={run.data_path}", tokenizer,
                             v.calibration_max_prompts, verifier.max_length, cfg.max_new_tokens + room, sample_ids=ids)
        context = sorted(lengths)[len(lengths) // 2] + cfg.max_new_tokens // 2
        reach = {name: reach_rates(ts, drafters[name].num_speculative_tokens) for name, ts in decode(ps).items()}
        chosen = {"set": ps.summary(), "reach": reach, "context": context,
                  "k": {name: cost.best_fixed_k(r, profile, name, context) for name, r in reach.items()}}
    for name, drafter in drafters.items():
        if chosen is not None:
            policies[name][cost.FixedK.label] = cost.FixedK(chosen["k"][name])
        if drafter.confidence is not None:
            policies[name][cost.CostDriven.label] = cost.CostDriven(profile, name)
    return policies, profile, chosen


def run_decode(cfg: DecodeConfig, teacher_forced: dict | None = None, output: str | None = None,
               progress: bool = True) -> tuple[dict, Path]:
    from tqdm import tqdm

    from dspark.decode import cost
    from dspark.decode.drafter import drafter_for
    from dspark.decode.loop import autoregressive, speculative
    from dspark.data.prompts import LONG_BUCKETS, load_prompt_set
    from dspark.decode.report import long_context_rows, markdown, plot, tracked
    from dspark.decode.verifier import Verifier
    from dspark.train.model import load_checkpoint
    from dspark.core.report import write_report
    from dspark.data.prepare import load_tokenizer
    from dspark.tracking.run import log_results, results_trackers
    from dspark.train.checkpoint import require_checkpoint
    from dspark.train.config import TrainConfig

    cfg.validate()
    ckpt = require_checkpoint(cfg.checkpoint)
    run_root = ckpt.parent.parent
    results_trackers(ckpt)  # they get the results: a damaged trackers.json is one line now, not after decoding
    run = TrainConfig.load(run_root) if (run_root / "config.json").exists() else None
    verifier_path = cfg.verifier or (run.verifier_name_or_path if run else None)
    specs = cfg.prompts or ([f"train-data={run.data_path}"] if run else [])
    if not specs:
        raise InputError(f"{ckpt} is not inside a run folder, so there are no default prompts", "pass --prompts FILE")
    device = torch.device("cpu")
    model = load_checkpoint(ckpt, verifier_path, device).to(getattr(torch, cfg.dtype))
    verifier_path = model.config.speculators_config.verifier.name_or_path
    drafter = drafter_for(model, cfg.layout, cfg.num_speculative_tokens)
    verifier = Verifier(verifier_path, model.target_layer_ids, cfg.dtype, device)
    tokenizer = load_tokenizer(verifier_path)
    eos = {tokenizer.eos_token_id} - {None}
    n_spec = drafter.num_speculative_tokens
    sets = [load_prompt_set(spec, tokenizer, cfg.max_prompts, verifier.max_length, cfg.max_new_tokens + drafter.slots)
            for spec in specs]
    first = next((list(ps.prompts[0].ids) for ps in sets if ps.prompts), None)
    if first is not None:  # one-time costs (allocator, kernels' first calls) stay out of the timings
        speculative(verifier, drafter, first[:64], 4, sampling=cfg)  # a short prompt will do
        autoregressive(verifier, first[:64], 4, sampling=cfg)

    def decode(ps):  # the calibration prompts, every draft verified
        gen = torch.Generator().manual_seed(cfg.seed)
        return {DRAFTER: [speculative(verifier, drafter, list(p.ids), cfg.max_new_tokens, sampling=cfg, eos=eos,
                                      gen=gen)
                          for p in tqdm(ps.prompts, desc=f"calibrate {ps.name}", unit="prompt", disable=not progress)]}

    policies, profile, chosen = verification(cfg, verifier, {DRAFTER: drafter}, sets, run, tokenizer, eos, progress,
                                             decode)
    policies = policies[DRAFTER]
    if cfg.confidence_threshold is not None and drafter.confidence is not None:
        policies[cost.ConfidenceCut.label] = cost.ConfidenceCut(cfg.confidence_threshold)
    datasets = [decode_set(cfg, ps, verifier, drafter, eos, policies, progress) for ps in sets]

    long_sets = [d for d in datasets if d["by_bucket"] or d["too_long"]]
    result = {"checkpoint": str(ckpt), "verifier": str(verifier_path), "layout": cfg.layout,
              "num_speculative_tokens": n_spec, "sampling": _sampling(cfg),
              "max_new_tokens": cfg.max_new_tokens, "confidence_threshold": cfg.confidence_threshold,
              "config": asdict(cfg), "cost_profile": profile and profile.to_dict(), "calibration": chosen,
              "recommendation": recommend(_served_by(ckpt, cfg.layout), drafter, profile, chosen),
              "datasets": [d for d in datasets if "decoded" in d],
              "long_buckets": LONG_BUCKETS, "long_context": long_context_rows(long_sets, LONG_BUCKETS)}
    if teacher_forced:
        result["teacher_forced"] = {k: teacher_forced[k] for k in ("tau_greedy", "tau_analytic")}
    if not result["datasets"]:
        raise InputError("no prompt could be decoded: every one is beyond the verifier's maximum length "
                         f"({verifier.max_length})", "pass shorter prompts or a lower --max-new-tokens")
    for d in result["datasets"]:  # tuple keys are for building the table; JSON gets "subdomain/bucket"
        d["by_bucket"] = {f"{s or '-'}/{b}": v for (s, b), v in d["by_bucket"].items()}
        d["too_long"] = {f"{s or '-'}/{b}": v for (s, b), v in d["too_long"].items()}
    out = Path(output) if output else ckpt / EVAL_DIR
    write_report(result, out, "decode", markdown, plot, f"{run_root.name}/{ckpt.name}: speculative decoding")
    log_results(ckpt, tracked(result), [out / "decode.png"])
    return result, out


def _served_by(ckpt: Path, layout: str) -> tuple[str, bool]:
    """(the vLLM method whose drafting this decode reproduced, whether that method sizes its steps adaptively):
    the one serve-draft picks for the checkpoint, or V1's DFlash proposer's for the dflash-v1 layout."""
    from dspark.kinds import kind_of
    from dspark.train.checkpoint import read_config

    config = read_config(ckpt)
    kind = kind_of(config, f"{ckpt}/config.json")
    method = kind.decoded_as(config, layout)
    return method, kind.adaptive_verification and method == kind.vllm_method


def recommend(served: tuple[str, bool], drafter, profile, chosen: dict | None) -> dict | None:
    """The draft count to serve this checkpoint with under vLLM's `method`, from the same profile and calibration,
    and why in one line (None: not measured). vLLM's DSpark proposer drafts its whole block; on a GPU its adaptive
    verification sizes each step as the cost-driven decode here does."""
    from dspark.decode import cost

    if profile is None or chosen is None:
        return None
    method, adaptive = served
    k, n, ctx = chosen["k"][DRAFTER], drafter.num_speculative_tokens, chosen["context"]
    reach = chosen["reach"][DRAFTER]
    shown = max(k, 1)
    rates = cost.expected_rates(reach[:shown], [profile.draft(DRAFTER, j) for j in range(1, shown + 1)],
                                [profile.check(j + 1, ctx) for j in range(shown + 1)])
    why = (f"on this machine, at {ctx} tokens of context, a check of {shown + 1} tokens costs "
           f"{profile.check(shown + 1, ctx):.1f} ms and a proposal {profile.draft(DRAFTER, shown):.1f} ms, against "
           f"{profile.check(1, ctx):.1f} ms for the verifier's token alone; the calibration prompts accept "
           f"{', '.join(f'{r:.2f}' for r in reach[:shown])} of steps through position{'s 1..' if shown > 1 else ' '}"
           f"{shown}: " + (f"{k} drafts give the most tokens per second, {rates[k] / rates[0]:.2f}x the verifier alone"
                           if k else f"the verifier alone is faster ({rates[1] / rates[0]:.2f}x with one draft)"))
    out = {"num_speculative_tokens": k, "method": method, "why": why, "measured_at": chosen["context"]}
    if adaptive and drafter.confidence is not None:
        out.update(num_speculative_tokens=n, enable_adaptive_verification=True, fixed_k=k,
                   why=f"vLLM's DSpark proposer drafts its block of {n} and, with enable_adaptive_verification (a GPU, "
                       f"Model Runner V2), verifies per step what its confidences pay for; fixed, {why}")
    return out
