"""`dspark compare`: drafters of every kind, and prompt lookup, side by side in one decode loop.

Same verifier, same prompts, same seeds: each prompt's forward is done once, the verifier alone
decodes it once (the speedup's baseline), then every drafter decodes it from that forward's
cache. The verifier captures the union of the drafters' target layers; each drafter reads its
own. Per prompt set (and per sub-domain: MT-bench category, LongBench dataset and length) one
row per drafter: per-position acceptance, mean acceptance length, drafted tokens/s, speedup over
the verifier alone, training steps and wall time, drafter parameters. A step without drafts
(prompt lookup finding no match) yields one token: the table's mean acceptance length counts
every verifier step, so rows compare as tokens per verifier forward; the drafted steps and
vLLM's per-draft mean (steps with drafts only) are beside it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.decode.config import CompareConfig
from dspark.core.errors import InputError
from dspark.core.report import EVAL_DIR


@dataclass
class Row:
    """One drafter of the comparison and what is known of how it was made."""

    name: str
    kind: str            # dspark, dflash, eagle3, ngram
    drafter: object
    folder: str | None = None
    params: int = 0      # the drafter's own weights (the verifier's borrowed ones are not in its file)
    train_steps: int | None = None
    train_s: float | None = None
    checkpoint: Path | None = None  # a training checkpoint (not an export): the comparison is recorded beside it


class LayerSelect:
    """A drafter reading its own target layers out of the states the verifier captures for all of them."""

    def __init__(self, drafter, select: list[int], captured: int):
        self.drafter, self.select, self.captured = drafter, select, captured

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def _states(self, states: torch.Tensor) -> torch.Tensor:
        n = len(states)
        return states.view(n, self.captured, -1)[:, self.select].reshape(n, -1)

    def context(self, tokens, states):
        return self.drafter.context(tokens, self._states(states))

    def extend(self, ctx, tokens, states) -> None:
        self.drafter.extend(ctx, tokens, self._states(states))


def training_record(ckpt: Path) -> tuple[int | None, float | None]:
    """(steps, wall-clock seconds) the checkpoint was trained for, from its trainer state (None: unknown)."""
    from dspark.train.checkpoint import load_trainer_state

    if not (ckpt / "trainer_state.pt").exists():  # an export: its run is elsewhere
        return None, None
    st = load_trainer_state(ckpt)
    return int(st["state"]["step"]), st.get("train_s")


def load_rows(cfg: CompareConfig) -> tuple[list[Row], str]:
    """The drafters (loaded) and the verifier folder they share."""
    from dspark.decode.drafter import drafter_for
    from dspark.train.model import load_checkpoint
    from dspark.kinds import DSPARK_LAYOUT
    from dspark.train.checkpoint import weight_count
    from dspark.train.checkpoint import read_config, require_checkpoint

    rows, verifier = [], cfg.verifier
    for spec in cfg.drafters:
        name, folder = spec.split("=", 1)
        ckpt = require_checkpoint(folder)
        verifier = verifier or read_config(ckpt)["speculators_config"]["verifier"]["name_or_path"]
        model = load_checkpoint(ckpt, verifier, torch.device("cpu")).to(getattr(torch, cfg.dtype))  # checks the kind
        steps, seconds = training_record(ckpt)
        # compare has no --layout: a DFlash-family checkpoint drafts as vLLM's DSpark speculator would serve it
        rows.append(Row(name, model.config.speculators_model_type, drafter_for(model, DSPARK_LAYOUT), folder,
                        weight_count(ckpt / "model.safetensors") or 0, steps, seconds,
                        checkpoint=ckpt if steps is not None else None))
    if verifier is None or not (Path(verifier) / "config.json").exists():
        raise InputError(f"no local verifier folder to decode with (the drafters name {verifier!r})",
                         "pass --verifier FOLDER")
    return rows, verifier


def _calibration_run(rows: list[Row]):
    """The run whose validation split calibrates (the first drafter trained in a run folder), or None."""
    from dspark.train.config import TrainConfig

    for r in rows:
        if r.checkpoint is not None and (r.checkpoint.parent.parent / "config.json").exists():
            return TrainConfig.load(r.checkpoint.parent.parent)
    return None


def _row(traces: list, alone: list, n: int, base: float) -> dict:
    """A verification policy's decode of a set: its summary, speedup, and how many outputs are the verifier's."""
    from dspark.decode.report import summarize
    from dspark.decode.run import verification_row

    return {**verification_row(summarize(traces, n), base),
            "outputs_equal_verifier_only": sum(a.tokens == b.tokens for a, b in zip(traces, alone))}


def run_compare(cfg: CompareConfig, progress: bool = True) -> tuple[dict, Path]:
    from tqdm import tqdm

    from dspark.decode.loop import autoregressive, prefill_each, speculative
    from dspark.decode.ngram import NgramDrafter
    from dspark.data.prompts import context_bucket, load_prompt_set
    from dspark.decode.report import by_subdomain, summarize
    from dspark.decode.run import FIXED_N, verification
    from dspark.decode.verifier import Verifier
    from dspark.core.report import write_report
    from dspark.data.prepare import load_tokenizer

    cfg.validate()
    rows, verifier_path = load_rows(cfg)
    layers = sorted({i for r in rows for i in r.drafter.model.target_layer_ids})
    verifier = Verifier(verifier_path, layers, cfg.dtype)
    for r in rows:
        r.drafter = LayerSelect(r.drafter, [layers.index(i) for i in r.drafter.model.target_layer_ids], len(layers))
    if cfg.ngram:
        rows.append(Row("ngram", "ngram", NgramDrafter(verifier.model.config.vocab_size, cfg.ngram_tokens, cfg.lookup,
                                                       verifier.max_length)))
    tokenizer = load_tokenizer(verifier_path)
    eos = {tokenizer.eos_token_id} - {None}
    banned = eos if cfg.ignore_eos else set()
    kw = dict(sampling=cfg, eos=eos)
    room = max(r.drafter.slots for r in rows)
    drafters = {r.name: r.drafter for r in rows}
    prompt_sets = [load_prompt_set(spec, tokenizer, cfg.max_prompts, verifier.max_length, cfg.max_new_tokens + room)
                   for spec in cfg.prompts]

    def decode(ps, policies=None, label=None, baseline=True):
        """Every prompt of `ps` by each drafter (with its policy of `policies`) and, with `baseline`, by the verifier
        alone."""
        traces: dict[str, list] = defaultdict(list)
        for i, prompt in enumerate(tqdm(ps.prompts, desc=f"{label or 'compare'} {ps.name}", unit="prompt",
                                        disable=not progress)):
            ids = list(prompt.ids)
            seeded = lambda: torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)  # noqa: E731
            pres = prefill_each(verifier, [None, *drafters.values()], ids, banned)
            if baseline:
                alone = autoregressive(verifier, ids, cfg.max_new_tokens, gen=seeded(), prefilled=pres[0], **kw)
                traces["verifier"].append(alone)
            for (name, drafter), pre in zip(drafters.items(), pres[1:]):
                traces[name].append(speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(),
                                                prefilled=pre, **kw))
                for label_, policy in (policies or {}).get(name, {}).items():
                    traces[(name, label_)].append(
                        alone if policy.max_drafts == 0 else
                        speculative(verifier, drafter, ids, cfg.max_new_tokens, gen=seeded(), verify=policy,
                                    prefilled=pre, **kw))
        return traces

    policies, profile, chosen = verification(
        cfg, verifier, drafters, prompt_sets, _calibration_run(rows), tokenizer, eos, progress,
        lambda ps: decode(ps, label="calibrate", baseline=False))
    sets = []
    for ps in prompt_sets:
        traces = decode(ps, policies)
        if not ps.prompts:
            continue
        keys = [(p.subdomain, context_bucket(p.length) if ps.longbench else None) for p in ps.prompts]
        alone = traces["verifier"]
        base = sum(len(t.tokens) for t in alone) / sum(t.seconds for t in alone)
        entry = {**ps.summary(), "verifier_only_tokens_per_s": base, "drafters": {}}
        for r in rows:
            n = r.drafter.num_speculative_tokens
            s = summarize(traces[r.name], n)
            groups = [(f"{sub or '-'}" + (f"/{bucket}" if bucket else ""), t) for (sub, bucket), t in
                      zip(keys, traces[r.name])]
            entry["drafters"][r.name] = {
                **s, "speedup": s["tokens_per_s"] / base,
                "by_subdomain": by_subdomain(groups, n) if any(g != "-" for g, _ in groups) else {},
                "outputs_equal_verifier_only": sum(a.tokens == b.tokens for a, b in zip(traces[r.name], alone)),
                "verification": {label: _row(traces[(r.name, label)] if label != FIXED_N else traces[r.name], alone,
                                             n, base) for label in [FIXED_N, *policies[r.name]]}}
        sets.append(entry)
    if not sets:
        raise InputError("no prompt could be decoded: every one is beyond the verifier's maximum length",
                         "pass shorter prompts or a lower --max-new-tokens")
    result = {"verifier": verifier_path, "config": asdict(cfg), "captured_layers": layers,
              "cost_profile": profile and profile.to_dict(), "calibration": chosen,
              "drafters": [{"name": r.name, "kind": r.kind, "folder": r.folder, "params": r.params,
                            "num_speculative_tokens": r.drafter.num_speculative_tokens,
                            "train_steps": r.train_steps, "train_s": r.train_s} for r in rows],
              "datasets": sets}
    out = Path(cfg.output)
    title = "drafters side by side: mean acceptance length per set"
    write_report(result, out, "compare", markdown, plot, title)
    for r in rows:  # in each checkpoint's eval/, as `dspark eval` does: its exported model card shows the table
        if r.checkpoint is not None:
            write_report({**result, "checkpoint": str(r.checkpoint), "row": r.name}, r.checkpoint / EVAL_DIR,
                         "compare", markdown, plot, title)
    return result, out


# --- the report --------------------------------------------------------------------------------

def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _length(s: dict) -> str:
    se = s.get("mean_acceptance_length_se")
    return f"{s['mean_acceptance_length']:.2f}" + ("" if se is None else f" ± {se:.2f}")


def markdown(result: dict) -> str:
    c = result["config"]
    sampling = "greedy" if c["temperature"] == 0 else f"temperature {c['temperature']}"
    n = max(d["num_speculative_tokens"] for d in result["drafters"])
    lines = [f"Drafters side by side on `{Path(result['verifier']).name}`: the same prompts and seeds in one decode "
             f"loop, {sampling}, up to {c['max_new_tokens']} new tokens per prompt.", "",
             "| drafter | kind | parameters | training steps | training time | drafts/step |", "|---|---|---:|---:|---:|---:|"]
    for d in result["drafters"]:
        took = "-" if d["train_s"] is None else f"{d['train_s'] / 60:.1f} min"
        lines.append(f"| {d['name']} | {d['kind']} | {d['params'] / 1e6:.2f} M | {_cell(d['train_steps'], 'd')} | "
                     f"{took} | {d['num_speculative_tokens']} |")
    pos = " | ".join(str(k) for k in range(1, n + 1))
    for ds in result["datasets"]:
        lines += ["", f"**{ds['name']}** ({ds['prompts']} prompts; the verifier alone: "
                      f"{ds['verifier_only_tokens_per_s']:.1f} tok/s)", "",
                  f"| drafter | {pos} | mean length | drafted steps | per drafted step | drafted tok/s | tok/s | "
                  "speedup |", "|---|" + "---:|" * n + "---:|---:|---:|---:|---:|---:|"]
        for name, s in ds["drafters"].items():
            rates = [f"{p['rate']:.3f}" for p in s["positions"]] + [""] * (n - len(s["positions"]))
            lines.append(f"| {name} | {' | '.join(rates)} | {_length(s)} | "
                         f"{s['drafted_steps']} of {s['drafts']} | {s['mean_acceptance_length_drafted']:.2f} | "
                         f"{s['drafted_tokens_per_s']:.0f} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f}x |")
    lines += _verification_lines(result)
    subs = [ds for ds in result["datasets"] if any(s["by_subdomain"] for s in ds["drafters"].values())]
    if subs:
        names = list(result["datasets"][0]["drafters"])
        lines += ["", "Mean acceptance length per sub-domain (MT-bench category; LongBench dataset/length):", "",
                  f"| set | sub-domain | {' | '.join(names)} |", "|---|---|" + "---:|" * len(names)]
        for ds in subs:
            groups = list(next(iter(ds["drafters"].values()))["by_subdomain"])
            for g in groups:
                cells = [_length(ds['drafters'][n]['by_subdomain'][g]) for n in names]
                lines.append(f"| {ds['name']} | {g} | {' | '.join(cells)} |")
    lines += ["", "Mean length counts every verifier step (tokens per forward); a step without drafts (prompt lookup "
              "found no match) yields the verifier's token alone. *Per drafted step* is vLLM's mean acceptance "
              "length, over the steps that carried drafts. ± is the standard error over prompts (a prompt's steps "
              "are not independent draws): two drafters closer than about twice it are not told apart by these "
              "prompts."]
    return "\n".join(lines) + "\n"


def _verification_lines(result: dict) -> list[str]:
    """Per set and drafter: every draft verified (fixed N), the best fixed k, cost-driven (a confidence head)."""
    from dspark.decode.report import profile_lines

    if not result.get("cost_profile"):
        return []
    lines = profile_lines(result["cost_profile"])
    chosen = result.get("calibration")
    if chosen:
        ks = ", ".join(f"{name} {k}" for name, k in chosen["k"].items())
        lines += ["", f"Best fixed k per drafter ({ks}; 0: the verifier alone), each from its acceptance on "
                  f"{chosen['set']['prompts']} calibration prompts ({chosen['set']['name']}, never a reported set) "
                  f"and the costs above at {chosen['context']} tokens of context."]
    else:
        lines += ["", "No best fixed k: no drafter comes from a run folder whose validation split could calibrate it "
                  "(pass --calibration-prompts)."]
    lines += ["", "| dataset | drafter | verification | mean length | drafts verified/step | tok/s | speedup |",
              "|---|---|---|---:|---:|---:|---:|"]
    for ds in result["datasets"]:
        for name, s in ds["drafters"].items():
            for label, v in s.get("verification", {}).items():
                lines.append(f"| {ds['name']} | {name} | {label} | {v['mean_acceptance_length']:.2f} | "
                             f"{v['verified_per_step']:.2f} | {v['tokens_per_s']:.1f} | {v['speedup']:.2f}x |")
    return lines


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = result["datasets"]
    names = [d["name"] for d in result["drafters"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(sets) * len(names) / 2), 4))
    x, width = np.arange(len(sets)), 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [ds["drafters"][name]["mean_acceptance_length"] for ds in sets]
        errs = [ds["drafters"][name].get("mean_acceptance_length_se") or 0.0 for ds in sets]
        bars = ax.bar(x - 0.4 + width * (i + 0.5), vals, width, yerr=errs, capsize=2, label=name, color=f"C{i}",
                      error_kw={"linewidth": 0.8})
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")  # the verifier alone: one token per forward
    ax.set_xticks(x, [ds["name"] for ds in sets])
    ax.set(ylabel="mean acceptance length (tokens per verifier step)\nerror bars: ± one standard error over prompts")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    from dspark.core.report import save_figure

    save_figure(fig, path, title)
