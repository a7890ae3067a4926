"""`dspark eval --decode`: a checkpoint decoding for real, on named prompt sets, against the verifier alone."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

from dspark.decode.config import DecodeConfig
from dspark.core.errors import InputError
from dspark.core.report import EVAL_DIR


def _sampling(cfg: DecodeConfig) -> str:
    if cfg.temperature == 0:
        return "greedy"
    return f"temperature {cfg.temperature}, {cfg.draft_sample} drafts, {cfg.rejection} rejection sampling"


def decode_set(cfg: DecodeConfig, ps, verifier, drafter, eos: set[int], use_confidence: bool, progress: bool) -> dict:
    """One prompt set: each prompt decoded speculatively, by the verifier alone, and with confidence cuts."""
    from tqdm import tqdm

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
        # the prompt's forward once for all three decodes; each is charged its measured time (loop.py)
        pre = prefill(verifier, drafter, ids, eos if cfg.ignore_eos else set())
        runs["decoded"].append(speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(), prefilled=pre,
                                           **kw))
        runs["verifier_only"].append(autoregressive(verifier, ids, cfg.max_new_tokens, gen=seeded(), prefilled=pre,
                                                    **kw))
        if use_confidence:
            runs["confident"].append(speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(),
                                                 confidence_threshold=cfg.confidence_threshold, prefilled=pre,
                                                 **kw))
        by_sub[(prompt.subdomain, context_bucket(prompt.length))].append(runs["decoded"][-1])
    entry = {**ps.summary(), "by_bucket": {}, "by_subdomain": {}, "too_long": dict(ps.too_long) if ps.longbench else {}}
    if not runs["decoded"]:  # a LongBench set entirely beyond the verifier's length: only its buckets report
        return entry
    decoded = summarize(runs["decoded"], n_spec)
    alone = runs["verifier_only"]
    base_tokens, base_s = sum(len(t.tokens) for t in alone), sum(t.seconds for t in alone)
    per_token = 1000 * sum(t.verify_s for t in alone) / max(base_tokens - len(alone), 1)  # after the prompt's
    entry.update(decoded=decoded, speedup=decoded["tokens_per_s"] / (base_tokens / base_s),
                 verifier_only={"tokens": base_tokens, "seconds": base_s, "tokens_per_s": base_tokens / base_s,
                                "ms_per_token": per_token})
    if ps.longbench:
        entry["by_bucket"] = {k: summarize(v, n_spec) for k, v in by_sub.items()}
    if any(sub is not None for sub, _ in by_sub):  # MT-bench categories, LongBench datasets: first-seen order
        entry["by_subdomain"] = by_subdomain([(sub, t) for (sub, _), ts in by_sub.items() for t in ts], n_spec)
    if cfg.temperature == 0:  # greedy speculative decoding must reproduce the verifier's own output
        entry["outputs_equal_verifier_only"] = sum(a.tokens == b.tokens for a, b in zip(runs["decoded"], alone))
    if use_confidence:
        entry["confident"] = summarize(runs["confident"], n_spec)
    return entry


def run_decode(cfg: DecodeConfig, teacher_forced: dict | None = None, output: str | None = None,
               progress: bool = True) -> tuple[dict, Path]:
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
    use_confidence = cfg.confidence_threshold is not None and drafter.confidence is not None

    datasets, warm = [], False
    for spec in specs:
        ps = load_prompt_set(spec, tokenizer, cfg.max_prompts, verifier.max_length, cfg.max_new_tokens + drafter.slots)
        if ps.prompts and not warm:  # one-time costs (allocator, kernels' first calls) stay out of the timings
            speculative(verifier, drafter, list(ps.prompts[0].ids)[:64], 4, sampling=cfg)  # a short prompt will do
            autoregressive(verifier, list(ps.prompts[0].ids)[:64], 4, sampling=cfg)
            warm = True
        datasets.append(decode_set(cfg, ps, verifier, drafter, eos, use_confidence, progress))

    long_sets = [d for d in datasets if d["by_bucket"] or d["too_long"]]
    result = {"checkpoint": str(ckpt), "verifier": str(verifier_path), "layout": cfg.layout,
              "num_speculative_tokens": drafter.num_speculative_tokens, "sampling": _sampling(cfg),
              "max_new_tokens": cfg.max_new_tokens,
              "confidence_threshold": cfg.confidence_threshold if use_confidence else None,
              "config": asdict(cfg), "datasets": [d for d in datasets if "decoded" in d],
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
