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

The numbers are computed from speculators' own forward: we observe the logits,
targets and anchors it produces rather than re-implementing the drafter.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark.errors import InputError
from dspark.eval.report import EVAL_DIR, save_figure, write_report
from dspark.tracking.run import log_results

if TYPE_CHECKING:  # torch loads inside the functions: `dspark eval`'s settings import this module's constants
    import torch

BUCKET_EDGES = [0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
# Blocks scored per eval, over all batches: a rate's standard error is at most 0.5/sqrt(2048) = 0.011,
# and 2048 blocks take about a minute on 2 CPU cores for a 135M verifier (every anchor of 24
# ShareGPT samples, 17,765 blocks, took 12 minutes). 0 scores every anchor.
MAX_ANCHORS = 2048
ANCHOR_SEED = 0  # which anchors: the same seed scores the same blocks, so two checkpoints compare on them


@contextmanager
def observe_forward():
    """Record the (logits, targets, loss mask, anchors) speculators computes inside forward."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    seen: dict = {}
    dspark_fn, dflash_fn, anchors_fn = dspark_core.compute_metrics, dflash_core.compute_metrics, dflash_core.select_anchors

    def dspark_spy(logits, targets, confidence_logits, loss_mask, *a, **kw):
        seen.update(logits=logits, targets=targets, confidence=confidence_logits, mask=loss_mask)
        return dspark_fn(logits, targets, confidence_logits, loss_mask, *a, **kw)

    def dflash_spy(logits, targets, loss_mask, *a, **kw):  # a DFlash drafter: no confidence head
        seen.update(logits=logits, targets=targets, confidence=None, mask=loss_mask)
        return dflash_fn(logits, targets, loss_mask, *a, **kw)

    def anchors_spy(*a, **kw):
        seen["anchors"] = anchors_fn(*a, **kw)
        return seen["anchors"]

    dspark_core.compute_metrics, dflash_core.compute_metrics = dspark_spy, dflash_spy
    dflash_core.select_anchors = anchors_spy
    try:
        yield seen
    finally:
        dspark_core.compute_metrics, dflash_core.compute_metrics = dspark_fn, dflash_fn
        dflash_core.select_anchors = anchors_fn


def load_checkpoint(ckpt: Path, verifier: str | None, device: torch.device):
    """The drafter in `ckpt` (a folder `require_checkpoint` accepted), with every tensor it saves loaded."""
    from safetensors import SafetensorError

    from dspark.kinds import kind_of
    from dspark.train.checkpoint import check_weight_names, damaged, first_line, read_config, weight_names
    from dspark.train.model import attn_impl

    ckpt = Path(ckpt)
    kind = kind_of(read_config(ckpt), f"{ckpt}/config.json")
    try:
        config = kind.config_class.from_pretrained(ckpt)
    except (OSError, ValueError, KeyError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise damaged(ckpt, f"config.json is not a {kind.name} drafter config ({first_line(e)})") from None
    config.transformer_layer_config._attn_implementation = attn_impl(device)
    verifier = verifier or config.speculators_config.verifier.name_or_path
    if not verifier or not Path(verifier).exists():
        raise InputError(f"the verifier {verifier!r} named by {ckpt} is not a local folder",
                         "pass --verifier-name-or-path the verifier folder")
    # The drafter borrows the verifier's embeddings, final norm and lm_head from this path.
    config.speculators_config.verifier.name_or_path = str(verifier)
    try:
        model = kind.model_class.from_pretrained(ckpt, config=config)
    except (SafetensorError, RuntimeError, ValueError) as e:  # a tensor of another shape, a damaged file
        raise damaged(ckpt, f"model.safetensors does not load ({first_line(e)})") from None
    # from_pretrained leaves a tensor the file lacks at its initial value with at most a log line
    check_weight_names(model, weight_names(ckpt), ckpt)
    return model.to(device).eval()


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


def evaluate(model, data, batches, device: torch.device, cfg, max_anchors: int = MAX_ANCHORS,
             anchor_seed: int = ANCHOR_SEED) -> dict:
    """Score `batches` with the loss settings of `cfg` (the run's TrainConfig) on a seeded sample of anchors."""
    from dataclasses import replace

    import torch
    from tqdm import tqdm

    from dspark.train.data import Loader
    from dspark.train.loop import to_device
    from dspark.train.model import loss_kwargs

    B = model.block_size
    available = [anchors_available(data, b, B) for b in batches]
    quota = allocate_anchors(available, max_anchors, anchor_seed)
    todo = [i for i, q in enumerate(quota) if q > 0]  # a batch with no anchor to score is not even read
    match, accept, conf, mask, ctx = [], [], [], [], []
    total = sum(available)
    loader = Loader(data, [batches[i] for i in todo], keep_empty=True)  # one item per batch, in order
    for i, batch in zip(todo, tqdm(loader, desc="eval", unit="batch", leave=False)):
        # fewer anchors than planned when a damaged sample was skipped, none when all of them were
        n_anchor = 0 if batch is None else int((batch["loss_mask"][0, :-B] > 0).sum())
        total -= available[i] - n_anchor
        k = min(quota[i], n_anchor)
        if k == 0:
            continue
        kw = loss_kwargs(model, replace(cfg, max_anchors=k), device)
        # select_anchors draws its k of the batch's anchors with torch's global generator: seed it per
        # batch, in a fork so the caller's random state is left as it was
        with torch.no_grad(), observe_forward() as seen, torch.random.fork_rng(devices=[]):
            torch.manual_seed(anchor_seed * 1_000_003 + i)
            model(**to_device(batch, device), **kw)
        logits, targets = seen["logits"][0].float(), seen["targets"][0].float()
        tv = 0.5 * (logits.softmax(-1) - targets.softmax(-1)).abs().sum(-1)
        anchors, valid = seen["anchors"]
        keep = valid.cpu().numpy()
        match.append((logits.argmax(-1) == targets.argmax(-1)).view(-1, B).cpu().numpy()[keep])
        accept.append((1 - tv).view(-1, B).cpu().numpy()[keep])
        mask.append(seen["mask"][0].view(-1, B).cpu().numpy()[keep].astype(bool))
        if seen["confidence"] is not None:
            conf.append(seen["confidence"][0].float().sigmoid().view(-1, B).cpu().numpy()[keep])
        ctx.append(batch["position_ids"][0, anchors.cpu()].numpy()[keep] + 1)
    if not match:
        raise InputError("no supervised positions to evaluate", "evaluate on samples with assistant tokens")
    match, accept, mask, ctx = (np.concatenate(x) for x in (match, accept, mask, ctx))
    conf = np.concatenate(conf) if conf else None
    if not model.config.sample_from_anchor:  # slot 0 holds the anchor and drafts nothing: position 1 is slot 1
        match, accept, mask = match[:, 1:], accept[:, 1:], mask[:, 1:]
        conf = None if conf is None else conf[:, 1:]
    result = summarize(match, accept, conf, mask, ctx)
    result["anchors"] = {"scored": int(len(mask)), "available": total,
                         "max_anchors": max_anchors or None, "seed": anchor_seed}
    return result


def _tau(rate: np.ndarray, mask: np.ndarray) -> float:
    """Mean over blocks of 1 + sum_k prod_{j<=k} rate_j (the bonus token always counts)."""
    prefix = np.cumprod(np.where(mask, rate, 0.0), axis=1)
    return float((1 + prefix.sum(1)).mean())


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
                    for k in ("greedy_match", "analytic_accept", "confidence") if k in p})
    return out


def _sample_note(result: dict) -> str:
    a = result.get("anchors")  # reports written before anchors were sampled have none
    if not a or a["scored"] >= a["available"]:
        return " (every anchor)" if a else ""
    return f" (a uniform sample of {a['scored']} of {a['available']} anchors, --anchor-seed {a['seed']})"


def markdown(result: dict) -> str:
    has_conf = "confidence" in result["positions"][0]
    lines = [f"tau (mean acceptance length, incl. bonus token): greedy **{result['tau_greedy']:.3f}**, "
             f"analytic **{result['tau_analytic']:.3f}** over {result['blocks']} blocks{_sample_note(result)}", "",
             "| pos | tokens | greedy match | 1-TV accept | greedy reach | analytic reach |"
             + (" confidence |" if has_conf else ""),
             "|---:|---:|---:|---:|---:|---:|" + ("---:|" if has_conf else "")]
    for p in result["positions"]:
        lines.append(f"| {p['position']} | {p['tokens']} | {p['greedy_match']:.3f} | {p['analytic_accept']:.3f} | "
                     f"{p['greedy_reach']:.3f} | {p['analytic_reach']:.3f} |"
                     + (f" {p['confidence']:.3f} |" if has_conf else ""))
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


def run_eval(checkpoint: str, store: str | None, data_path: str | None, verifier: str | None, output: str | None,
             split: str, device: str = "auto", on_damaged: str = "skip", max_anchors: int = MAX_ANCHORS,
             anchor_seed: int = ANCHOR_SEED) -> tuple[dict, Path]:
    """Score a checkpoint on a seeded sample of `max_anchors` blocks (0: all); damaged samples are skipped and
    named (`on_damaged="skip"`) or stop it ("raise")."""
    import sys

    from dspark.connector.zarr.reader import ZarrStore
    from dspark.prepare import PreparedData
    from dspark.train.checkpoint import require_checkpoint
    from dspark.train.config import TrainConfig
    from dspark.train.data import TrainData
    from dspark.train.loop import pick_device

    ckpt = require_checkpoint(checkpoint)
    dev = pick_device(device, 0)
    run_root = ckpt.parent.parent
    if (run_root / "config.json").exists():
        cfg = TrainConfig.load(run_root)
    elif data_path is None:
        raise InputError(f"{ckpt} is not inside a run folder, so the prepared data is unknown", "pass --data-path")
    else:  # a bare checkpoint: the loop's defaults
        cfg = TrainConfig(store=store, data_path=data_path, verifier_name_or_path=verifier or "", save_path="",
                          target_layer_ids=[])
    store = store or cfg.store  # a run records the store it trained from
    if not store:
        raise InputError(f"{ckpt} does not record its store", "pass --store")
    model = load_checkpoint(ckpt, verifier or cfg.verifier_name_or_path or None, dev)
    if model.config.speculators_model_type == "eagle3":
        raise InputError(f"{ckpt} is an EAGLE-3 drafter: teacher-forced eval scores the blocks of DFlash-family "
                         "drafters", "measure it by decoding: `dspark eval --decode` or `dspark compare`")
    source = ZarrStore(store)
    data = TrainData(source, PreparedData(data_path or cfg.data_path), cfg.total_seq_len, cfg.train_data_ratio,
                     cfg.seed, on_damaged, verifier or cfg.verifier_name_or_path or None,
                     layers=model.target_layer_ids)  # the drafter's layers, of the store's
    batches = data.val_batches() if split == "val" else data.pack(sorted(source.sample_ids))
    result = evaluate(model, data, batches, dev, cfg, max_anchors, anchor_seed)
    result.update(checkpoint=str(ckpt), store=str(store), split=split)
    if data.damaged:
        result["damaged_skipped"] = sorted(data.damaged)
        print(f"warning: {data.damaged_report()}", file=sys.stderr)
    out = Path(output) if output else ckpt / EVAL_DIR
    write_report(result, out, "eval", markdown, plot, f"{ckpt.parent.parent.name}/{ckpt.name} on {split}")
    log_results(ckpt, tracked(result), [out / "eval.png"])
    return result, out
