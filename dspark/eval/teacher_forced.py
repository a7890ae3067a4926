"""`dspark eval`: per-position acceptance of a checkpoint on held-out stored samples.

Every supervised position can anchor a block. By default a seeded, uniform sample of
`MAX_ANCHORS` of them is scored (every one when there are fewer, or with `max_anchors=0`):
the statistics below are means over blocks, so the sample estimates them without bias
(the per-position rates as ratios of sample sums), and the report says how many of how many
anchors were scored, with the seed. For block slot k we report the greedy match rate (argmax draft == argmax
verifier) and the analytical acceptance 1 - TV(draft, verifier) that rejection
sampling achieves, the same per position conditioned on all earlier slots being
accepted, and the mean acceptance length tau (accepted drafts + the bonus token),
overall and by context length (tokens before the anchor in its conversation).

The numbers come from speculators' own forward (its logits, targets and anchors, not a
re-implementation of the drafter), with one change that makes tau estimate decoded length: a
DSpark drafter's Markov head is fed its own previous draft, as in decoding, not the data's token
(`train/blocks.py`). The same blocks are scored again with the context states zeroed and with
another sample's: the state gain per position says how much of the acceptance the verifier's
states bring.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark.core.errors import InputError
from dspark.eval.config import TeacherForcedConfig
from dspark.core.report import EVAL_DIR, save_figure, write_report
from dspark.tracking.run import log_results, results_trackers

if TYPE_CHECKING:  # for annotations: the functions import torch where they use it
    import torch

BUCKET_EDGES = [0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def _buckets(ctx: np.ndarray) -> list[tuple[int, int]]:
    edges = [e for e in BUCKET_EDGES if e <= ctx.max()] + [int(ctx.max()) + 1]
    return [(a, b) for a, b in zip(edges, edges[1:]) if ((ctx >= a) & (ctx < b)).any()]


def anchors_available(data, batch: list[int], block_size: int) -> int:
    """The anchors speculators' select_anchors can pick in this packed batch (read from the prepared masks)."""
    masks = [data.prepared.sample(i)[1][: data.total_seq_len] for i in batch]
    return int((np.concatenate(masks)[:-block_size] > 0).sum())


def allocate_anchors(available: list[int], max_anchors: int, seed: int) -> list[int]:
    """Anchors to score per batch: the counts of a uniform random `max_anchors`-subset of all of them.

    Each batch then scores a uniform subset of its own of that size (select_anchors), so the
    blocks scored are a uniform sample of every anchor of the split; `max_anchors` 0 or at least
    the total keeps every one.
    """
    if not max_anchors or max_anchors >= sum(available):
        return list(available)
    return np.random.default_rng(seed).multivariate_hypergeometric(available, max_anchors).tolist()


def evaluate(model, data, batches, device: torch.device, max_anchors: int, anchor_seed: int,
             progress: bool = True) -> dict:
    """Score `batches` on a seeded sample of anchors, chaining the drafts as decoding does, with the real context
    states and each control (`train/blocks.py`)."""
    from tqdm import tqdm

    from dspark.train.blocks import Blocks, score_with_controls, sums, with_donors
    from dspark.train.data import Loader
    from dspark.train.device import input_dtype, to_device
    from dspark.train.metrics import accumulate, reduce

    B = model.block_size
    available = [anchors_available(data, b, B) for b in batches]
    quota = allocate_anchors(available, max_anchors, anchor_seed)
    todo = [i for i, q in enumerate(quota) if q > 0]  # a batch with no anchor to score is not even read
    total = sum(available)
    loader = Loader(data, [batches[i] for i in todo], keep_empty=True)  # one item per batch, in order
    planned: list[tuple[int, int]] = []  # (batch index, anchors to score) of each batch read

    def read():
        nonlocal total
        for i, batch in zip(todo, tqdm(loader, desc="eval", unit="batch", leave=False, disable=not progress)):
            # fewer anchors than planned when a damaged sample was skipped, none when all of them were
            n_anchor = 0 if batch is None else int((batch["loss_mask"][0, :-B] > 0).sum())
            total -= available[i] - n_anchor
            planned.append((i, min(quota[i], n_anchor)))
            yield batch if planned[-1][1] else None

    acc: dict[str, float] = {}  # each variant's match per position and tau, as training's validation sums them
    real, ctx = [], []
    dtype = input_dtype(model, autocast=False)  # the checkpoint's weights, as they are
    place = lambda b: to_device(b, device, dtype)  # noqa: E731
    for n, batch, donors in with_donors(read()):
        i, k = planned[n]
        # select_anchors draws with torch's global generator: seeded per batch, so every variant scores the same blocks
        scored = score_with_controls(model, batch, donors, place, k, anchor_seed * 1_000_003 + i)
        accumulate(acc, sums(scored))
        real.append(scored["real"])
        ctx.append(batch["position_ids"][0, real[-1].anchors].numpy() + 1)
    if not ctx:
        raise InputError("no supervised positions to evaluate", "evaluate on samples with assistant tokens")
    real = Blocks.concat(real)
    result = summarize(real.match, real.accept, real.confidence, real.mask, np.concatenate(ctx))
    add_controls(result, reduce(acc))
    result["anchors"] = {"scored": int(len(real.mask)), "available": total,
                         "max_anchors": max_anchors or None, "seed": anchor_seed}
    return result


def add_controls(result: dict, rates: dict[str, float]) -> None:
    """Each control's greedy match per position and tau beside the real ones, and the state gain (`blocks.state_gain`:
    the real rate minus the better control's), from the `metrics.reduce`d sums of `blocks.sums`."""
    from dspark.train.blocks import CONTROLS, state_gain

    gains = state_gain(rates)
    positions = [row["position"] for row in result["positions"]]
    # a control not formed (one batch of one sample: no other sample to take states from) summed nothing; a position
    # no block supervises has no rate, 0 as in `summarize`
    result["controls"] = {c: {"tau_greedy": rates[f"{c}_tau"],
                              "greedy_match": [rates.get(f"{c}_pos{k}_match", 0.0) for k in positions]}
                          if f"{c}_tau" in rates else None for c in CONTROLS}
    for k, row in zip(positions, result["positions"]):
        for name, c in result["controls"].items():
            row[f"{name}_match"] = None if c is None else rates.get(f"{name}_pos{k}_match", 0.0)
        row["state_gain"] = gains.get(f"state_gain_pos{k}_match", 0.0)
    result["state_gain"] = {"positions": [row["state_gain"] for row in result["positions"]],
                            "tau_greedy": gains["state_gain_tau"],
                            "against": "the better of " + " and ".join(
                                name.replace("_", " ") for name, c in result["controls"].items() if c is not None)}


def _tau(rate: np.ndarray, mask: np.ndarray) -> float:
    """Mean over blocks of 1 + sum_k prod_{j<=k} rate_j (the bonus token always counts)."""
    from dspark.train.blocks import tau

    return float(tau(rate, mask).mean())


def summarize(match, accept, conf, mask, ctx) -> dict:
    m = mask.astype(float)
    per_pos = m.sum(0)
    denom = np.maximum(per_pos, 1)
    greedy_prefix = np.cumprod(np.where(mask, match, 0.0), axis=1)
    analytic_prefix = np.cumprod(np.where(mask, accept, 0.0), axis=1)
    positions = []
    for k in range(mask.shape[1]):
        row = {"position": k + 1, "tokens": int(per_pos[k]),
               "greedy_match": float((match[:, k] * m[:, k]).sum() / denom[k]),
               "analytic_accept": float((accept[:, k] * m[:, k]).sum() / denom[k]),
               "greedy_reach": float(greedy_prefix[:, k].mean()),
               "analytic_reach": float(analytic_prefix[:, k].mean())}
        if conf is not None:
            row["confidence"] = float((conf[:, k] * m[:, k]).sum() / denom[k])
        positions.append(row)
    buckets = []
    for a, b in _buckets(ctx):
        sel = (ctx >= a) & (ctx < b)
        buckets.append({"context": f"{a}-{b - 1}", "blocks": int(sel.sum()),
                        "tau_greedy": _tau(match[sel], mask[sel]), "tau_analytic": _tau(accept[sel], mask[sel])})
    return {"blocks": int(len(mask)), "tau_greedy": _tau(match, mask), "tau_analytic": _tau(accept, mask),
            "positions": positions, "by_context": buckets}


def tracked(result: dict) -> dict[str, float]:
    """The figures a tracker charts per checkpoint: tau and per-position acceptance on the split."""
    pre = f"eval/{result['split']}"
    out = {f"{pre}/tau_greedy": result["tau_greedy"], f"{pre}/tau_analytic": result["tau_analytic"]}
    for p in result["positions"]:
        out.update({f"{pre}/position_{p['position']}_{k}": p[k]
                    for k in ("greedy_match", "analytic_accept", "confidence", "state_gain") if k in p})
    if "state_gain" in result:
        out[f"{pre}/state_gain_tau"] = result["state_gain"]["tau_greedy"]
    return out


def _sample_note(result: dict) -> str:
    a = result.get("anchors")  # reports written before anchors were sampled have none
    if not a or a["scored"] >= a["available"]:
        return " (every anchor)" if a else ""
    return f" (a uniform sample of {a['scored']} of {a['available']} anchors, --anchor-seed {a['seed']})"


def state_gain_line(result: dict) -> str | None:
    """One line: what the verifier's states bring at position 1 and to tau (None for a report without controls)."""
    gain = result.get("state_gain")
    if not gain:
        return None
    first = result["positions"][0]
    controls = ", ".join(f"{name.replace('_', ' ')} {first[f'{name}_match']:.3f}"
                         for name in result["controls"] if first.get(f"{name}_match") is not None)
    return (f"state gain (greedy match with the verifier's states minus {gain['against']} states): position 1 "
            f"**{gain['positions'][0]:+.3f}** (real {first['greedy_match']:.3f}; {controls}), "
            f"tau **{gain['tau_greedy']:+.3f}**")


def markdown(result: dict) -> str:
    has_conf = "confidence" in result["positions"][0]
    controls = [name for name in result.get("controls", {}) if result["controls"][name] is not None]
    gain = state_gain_line(result)
    lines = [f"tau (mean acceptance length, incl. bonus token): greedy **{result['tau_greedy']:.3f}**, "
             f"analytic **{result['tau_analytic']:.3f}** over {result['blocks']} blocks{_sample_note(result)}",
             *([""] + [gain] if gain else []), "",
             "| pos | tokens | greedy match | 1-TV accept | greedy reach | analytic reach |"
             + (" confidence |" if has_conf else "")
             + "".join(f" {name.replace('_', ' ')} |" for name in controls) + (" state gain |" if gain else ""),
             "|---:|---:|---:|---:|---:|---:|" + ("---:|" if has_conf else "") + "---:|" * (len(controls) + bool(gain))]
    for p in result["positions"]:
        lines.append(f"| {p['position']} | {p['tokens']} | {p['greedy_match']:.3f} | {p['analytic_accept']:.3f} | "
                     f"{p['greedy_reach']:.3f} | {p['analytic_reach']:.3f} |"
                     + (f" {p['confidence']:.3f} |" if has_conf else "")
                     + "".join(f" {p[f'{name}_match']:.3f} |" for name in controls)
                     + (f" {p['state_gain']:+.3f} |" if gain else ""))
    lines += ["", "| context tokens | blocks | tau greedy | tau analytic |", "|---|---:|---:|---:|"]
    lines += [f"| {b['context']} | {b['blocks']} | {b['tau_greedy']:.3f} | {b['tau_analytic']:.3f} |"
              for b in result["by_context"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    pos = [p["position"] for p in result["positions"]]
    for key, label in (("greedy_match", "greedy match"), ("analytic_accept", "1-TV accept"),
                       ("greedy_reach", "greedy reach (cumulative)"), ("analytic_reach", "analytic reach (cumulative)"),
                       ("confidence", "confidence head")):
        if key in result["positions"][0]:
            a.plot(pos, [p[key] for p in result["positions"]], marker="o", label=label,
                   linestyle="--" if "reach" in key else "-")
    for name, c in result.get("controls", {}).items():  # what the drafter scores without the verifier's states
        if c is not None:
            a.plot(pos, c["greedy_match"], marker=".", linestyle=":",
                   label=f"greedy match, {name.replace('_', ' ')} states")
    a.set(xlabel="block position", ylabel="rate", ylim=(0, 1.02), title="per-position acceptance")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    names = [x["context"] for x in result["by_context"]]
    x = np.arange(len(names))
    b.bar(x - 0.2, [v["tau_greedy"] for v in result["by_context"]], 0.4, label="greedy")
    b.bar(x + 0.2, [v["tau_analytic"] for v in result["by_context"]], 0.4, label="analytic")
    b.set_xticks(x, names, rotation=30, fontsize=8)
    b.set(xlabel="context tokens before the anchor", ylabel="tau", title="acceptance length by context")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, axis="y")
    save_figure(fig, path, title)


def run_eval(cfg: TeacherForcedConfig, progress: bool = True) -> tuple[dict, Path]:
    """Score a checkpoint on a seeded sample of `cfg.max_anchors` blocks (0: all); damaged samples are skipped and
    named (`--on-damaged skip`) or stop it (raise)."""
    import sys

    from dspark.train.checkpoint import require_checkpoint

    ckpt = require_checkpoint(cfg.checkpoint)  # a wrong folder is refused before anything imports torch
    from dspark.connector.base import open_store
    from dspark.kinds import kind_of
    from dspark.data.prepare import PreparedData
    from dspark.train.config import TrainConfig
    from dspark.train.data import TrainData
    from dspark.train.device import pick_device
    from dspark.train.model import load_checkpoint

    dev = pick_device(cfg.device, 0)
    run_root = ckpt.parent.parent
    results_trackers(ckpt)  # they get the results: a damaged trackers.json is one line now, not after the scoring
    store, data_path, verifier = cfg.store, cfg.data_path, cfg.verifier_name_or_path
    if (run_root / "config.json").exists():
        run = TrainConfig.load(run_root)
    elif data_path is None:
        raise InputError(f"{ckpt} is not inside a run folder, so the prepared data is unknown", "pass --data-path")
    else:  # a bare checkpoint: the loop's defaults
        run = TrainConfig(store=store, data_path=data_path, verifier_name_or_path=verifier or "", save_path="",
                          target_layer_ids=[])
    store = store or run.store  # a run records the store it trained from
    if not store:
        raise InputError(f"{ckpt} does not record its store", "pass --store")
    model = load_checkpoint(ckpt, verifier or run.verifier_name_or_path or None, dev)
    kind = kind_of(model.config.to_dict(), f"{ckpt}/config.json")
    if not kind.blocks:
        raise InputError(f"{ckpt} is an {kind.title} drafter: teacher-forced eval scores the blocks of DFlash-family "
                         "drafters", "measure it by decoding: `dspark eval --decode` or `dspark compare`")
    source = open_store(store, run.source)  # a live run's cache, or the store it read
    data = TrainData(source, PreparedData(data_path or run.data_path), run.total_seq_len, run.train_data_ratio,
                     run.seed, cfg.on_damaged, verifier or run.verifier_name_or_path or None,
                     layers=model.target_layer_ids)  # the drafter's layers, of the store's
    batches = data.val_batches() if cfg.split == "val" else data.pack(sorted(source.sample_ids))
    result = evaluate(model, data, batches, dev, cfg.max_anchors, cfg.anchor_seed, progress)
    result.update(checkpoint=str(ckpt), store=str(store), split=cfg.split)
    if data.damaged:
        result["damaged_skipped"] = sorted(data.damaged)
        print(f"warning: {data.damaged_report()}", file=sys.stderr)
    out = Path(cfg.output) if cfg.output else ckpt / EVAL_DIR
    write_report(result, out, "eval", markdown, plot, f"{ckpt.parent.parent.name}/{ckpt.name} on {cfg.split}")
    log_results(ckpt, tracked(result), [out / "eval.png"])
    return result, out
