"""speculators' own trainer and `dspark train`, side by side on one store: same data, verifier, settings, seed
and steps; both checkpoints scored by `dspark eval` on the same held-out states. Reports figures, asserts nothing.

    OMP_NUM_THREADS=2 python scripts/speculators_side_by_side.py --store STORE --data-path PREPARED \
        --verifier-name-or-path VERIFIER --config scripts/recipes/smollm2.yaml --steps 200 --seed 0 \
        [--train-flags "--epochs 1"] [--output DIR] [--max-anchors N] [--fresh]

(1) The settings are `dspark train --config CONFIG [--train-flags] ... --print-config`'s, with --seed,
    --max-steps and --log-freq 1 (a step time per step, for both trainers); both trainers get them.
(2) Export (cached in DIR/export, reused while the store, prepared data and layers are the same): every sample,
    read with dspark's own reader (TrainData: checksums checked), into speculators' offline `file` layout:
    an Arrow dataset (`input_ids`, `loss_mask`, `seq_len`; torch format) and hidden_states/hs_{row}.safetensors
    (`hidden_states [T, L+1, H]`: the drafter's target layers then the last layer, as the store decodes them;
    `token_ids [T]`). Rows are dspark's training samples, then its validation samples, and speculators'
    --train-data-ratio is chosen so that its split (the first int(ratio * N) rows) is exactly dspark's.
(3) `python -m speculators.train` (speculators 0.9.0), run in a child process of this script that patches, in
    that process only (site-packages untouched): on a machine without an accelerator, the trainer's `cuda`
    placement (Trainer.local_rank 0 -> cpu, autocast device "cuda" -> "cpu", torch.accelerator.synchronize ->
    no-op, checkpointer.get_current_device -> cpu); everywhere, --epochs cut to the epochs --max-steps reaches
    (speculators does one more step in every epoch after --max-steps) and a timestamp per step (its
    `step_callback`). Checkpoints in DIR/speculators/checkpoints/<epoch>.
(4) Then `dspark train` into DIR/dspark (the run folder). Each arm is reported with the share of the cores other
    processes used meanwhile (/proc/stat): on a shared machine that, not the trainer, can set the step time.
(5) `dspark eval` of DIR/dspark/latest, and of speculators' checkpoint (upcast from its bf16 save to fp32, in
    DIR/speculators/eval-run/checkpoints/final beside a copy of the dspark run's config.json, so that eval scores
    the same validation batches and anchors as for the dspark run).
(6) A Markdown table (tau, per-position greedy match, state gain at position 1, seconds per step) printed and
    written to DIR/side_by_side.md, everything in DIR/side_by_side.json, with the settings that could not be
    matched. Seconds per step: the median of the wall time between consecutive steps, steps 2..N.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = "--speculators-child"
KINDS_SUPPORTED = ("dspark", "dflash")  # block drafters: what `dspark eval` scores


# --- the child: speculators' CLI in this process, patched for the CPU and timed -----------------------------------

def run_speculators_child(timings_path: str, argv: list[str]) -> None:
    import runpy

    import torch

    from speculators.train import checkpointer, trainer

    report: dict = {"step_times": [], "patches": []}
    on_cpu = not torch.accelerator.is_available()
    T = trainer.Trainer
    if on_cpu:
        report["patches"] += ["Trainer.local_rank 0 -> torch.device('cpu'); autocast device 'cuda' -> 'cpu'",
                              "torch.accelerator.synchronize -> no-op (it raises without an accelerator)",
                              "checkpointer.get_current_device -> 'cpu' (it answers 'cuda:0')"]
        torch.accelerator.synchronize = lambda *a, **k: None
        checkpointer.get_current_device = lambda: "cpu"
        setup_trainer = T.setup_trainer

        def cpu_setup_trainer(self):  # runs after __init__ sets local_rank and device_type, before setup_model
            self.local_rank, self.device_type = torch.device("cpu"), "cpu"
            return setup_trainer(self)

        T.setup_trainer = cpu_setup_trainer

    train_epoch = T.train_epoch

    def timed_train_epoch(self, epoch, *, step_callback=None):
        def stamp():
            report["step_times"].append(time.perf_counter())
            if step_callback is not None:
                step_callback()
        return train_epoch(self, epoch, step_callback=stamp)

    T.train_epoch = timed_train_epoch
    run_training = T.run_training

    def bounded_run_training(self):
        per_epoch = len(self.train_loader)
        report["batches_per_epoch"] = per_epoch
        report["muon_split"] = muon_split(self.model)
        if self.config.max_steps is not None and per_epoch:
            epochs = min(self.config.num_epochs, math.ceil(self.config.max_steps / per_epoch))
            if epochs < self.config.num_epochs:
                report["patches"].append(f"--epochs {self.config.num_epochs} -> {epochs}: the epochs --max-steps "
                                         "reaches (each later epoch would train one more step)")
                self.config = self.config._replace(num_epochs=epochs)
        return run_training(self)

    T.run_training = bounded_run_training
    sys.argv = ["speculators.train", *argv]
    start = time.perf_counter()
    try:
        runpy.run_module("speculators.train", run_name="__main__", alter_sys=False)
    finally:
        report["wall_s"] = time.perf_counter() - start
        report["start"] = start
        Path(timings_path).write_text(json.dumps(report, indent=1))


def muon_split(model) -> dict:
    """The parameters dspark's Muon rule and speculators' put on different optimizers."""
    from dspark.train.model import muon_param
    from speculators.train.optimizers import split_named_params_for_muon

    spec_muon = {n for n, _ in split_named_params_for_muon(model)[0]}
    ours = {n for n, p in model.named_parameters() if p.requires_grad and muon_param(n, p)}
    return {"muon_in_dspark_only": sorted(ours - spec_muon), "muon_in_speculators_only": sorted(spec_muon - ours)}


# --- the parent ----------------------------------------------------------------------------------------------------

def sh(cmd: list[str], log: Path) -> float:
    """Run cmd with its output teed to `log`; the wall seconds, or exit naming the log."""
    print("+ " + " ".join(map(str, cmd)), flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
        rc = proc.wait()
    if rc:
        sys.exit(f"failed (exit {rc}): {' '.join(map(str, cmd))}\n  see {log}:\n"
                 + "".join(log.read_text().splitlines(keepends=True)[-15:]))
    return time.perf_counter() - start


def others_cpu_share(before: tuple[float, float, float]) -> float:
    """The share of the machine's cores other processes used since `before` (from `load_mark`)."""
    busy, mine, wall = load_mark()
    return max(0.0, (busy - before[0]) - (mine - before[1])) / max(1e-9, (wall - before[2]) * os.cpu_count())


def load_mark() -> tuple[float, float, float]:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return busy, ch.ru_utime + ch.ru_stime + me.ru_utime + me.ru_stime, time.perf_counter()


def step_seconds(times: list[float]) -> dict:
    """Median and mean wall seconds between consecutive steps, the first step (warm-up, setup) left out."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return {"median": None, "mean": None, "steps_timed": 0}
    return {"median": statistics.median(gaps), "mean": statistics.fmean(gaps), "steps_timed": len(gaps)}


def resolve_settings(args, dspark_run: Path) -> tuple[dict, list[str]]:
    flags = ["--config", args.config, *shlex.split(args.train_flags), "--store", args.store,
             "--data-path", args.data_path, "--verifier-name-or-path", args.verifier_name_or_path,
             "--save-path", dspark_run, "--seed", args.seed, "--max-steps", args.steps, "--log-freq", 1]
    out = subprocess.run([ROOT / ".venv/bin/dspark", "train", *map(str, flags), "--print-config"],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"dspark train --print-config failed:\n{out.stderr or out.stdout}")
    return json.loads(out.stdout), [str(f) for f in flags]


def export(cfg: dict, data, prepared, folder: Path) -> dict:
    """speculators' `file` layout of every sample, dspark's training split first (`data`: a TrainData)."""
    import torch
    from safetensors.torch import save_file

    order = [*data.train_ids, *data.val_ids]
    key = {"store": data.source.fingerprint(), "prepared": prepared.fingerprint,
           "layers": list(cfg["target_layer_ids"]), "order_train": len(data.train_ids), "rows": len(order),
           "order": hashlib.sha256(json.dumps(order).encode()).hexdigest()[:16]}
    marker = folder / "export.json"
    if marker.exists() and json.loads(marker.read_text()) == key:
        print(f"export: reusing {folder}", flush=True)
        return key
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "hidden_states").mkdir(parents=True)
    import datasets

    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    last = data.num_targets  # the store's last-layer slot follows its targets
    start = time.perf_counter()
    for row, sid in enumerate(order):
        s = data.read(sid)
        if s is None:
            sys.exit(f"sample {sid} of {cfg['store']} is damaged: repair the store ({data.repair}) first")
        tok, mask = prepared.sample(sid)
        if len(tok) != len(s.token_ids) or (tok != s.token_ids).any():
            sys.exit(f"sample {sid}: the store's token ids differ from {prepared.path}'s")
        h = s.hidden_states[:, [*data.layer_index, last]].contiguous()
        save_file({"hidden_states": h, "token_ids": torch.from_numpy(tok)},
                  str(folder / "hidden_states" / f"hs_{row}.safetensors"))
        cols["input_ids"].append(tok.tolist())
        cols["loss_mask"].append(mask.astype("int64").tolist())
        cols["seq_len"].append(len(tok))
        if row % 500 == 0:
            print(f"export: {row}/{len(order)} samples, {time.perf_counter() - start:.0f} s", flush=True)
    ds = datasets.Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(folder))
    marker.write_text(json.dumps(key))
    key["seconds"] = time.perf_counter() - start
    return key


def speculators_args(cfg: dict, args, export_dir: Path, save: Path, n_train: int, n_rows: int, total_steps: int,
                     mask_token: int, hidden_act: str, cuda: bool) -> list[str]:
    """speculators.train's flags for the same settings (those it has)."""
    dspark_kind = cfg["speculator_type"] == "dspark"
    autocast = cfg["autocast"] == "bf16" or (cfg["autocast"] == "auto" and cuda)
    if cfg["draft_config"]:  # the decoder from the file; speculators refuses the shaping flags beside it
        shape = ["--draft-config", cfg["draft_config"]]
    else:  # dspark builds every draft layer full-attention over the packed batch, with the verifier's activation
        shape = ["--num-layers", cfg["num_layers"], "--draft-arch", "qwen3", "--draft-hidden-act", hidden_act,
                 "--sliding-window", cfg["total_seq_len"], "--full-attention-indices", *range(cfg["num_layers"])]
    a = ["--speculator-type", cfg["speculator_type"], "--seed", args.seed,
         "--verifier-name-or-path", args.verifier_name_or_path, *shape,
         "--target-layer-ids", *cfg["target_layer_ids"], "--mask-token-id", mask_token,
         "--sliding-window-non-causal",  # what dspark's DFlash family passes (kinds/dflash.py)
         "--draft-attn-impl", "simple_flex_attention" if cuda else "sdpa",
         "--data-path", export_dir, "--hidden-states-backend", "file", "--on-missing", "raise",
         "--total-seq-len", cfg["total_seq_len"],
         "--train-data-ratio", (n_train + 0.5) / n_rows,  # its split: the first int(ratio * N) rows = dspark's
         "--hidden-states-dtype", "bfloat16" if autocast else "float32",
         "--num-workers", cfg["num_workers"], "--prefetch-factor", cfg["prefetch_factor"],
         "--max-anchors", cfg["max_anchors"],
         "--loss-implementation", "fused" if cuda else "eager", "--loss-fn", cfg["loss_fn"],
         "--optimizer", cfg["optimizer"], "--lr", cfg["lr"], "--weight-decay", cfg["weight_decay"],
         "--muon-lr", cfg["lr"], "--muon-weight-decay", cfg["weight_decay"], "--muon-momentum", 0.95,
         "--muon-ns-steps", 5, "--muon-adjust-lr-fn", "match_rms_adamw",
         "--scheduler-type", cfg["scheduler_type"], "--scheduler-warmup-ratio", cfg["scheduler_warmup_ratio"],
         "--scheduler-total-steps", total_steps,  # dspark's schedule spans all its epochs, whatever --max-steps
         "--epochs", cfg["epochs"], "--checkpoint-freq", 1, "--log-freq", 1, "--max-steps", args.steps,
         "--save-path", save, "--log-dir", save.parent / "logs", "--no-resume-from-checkpoint",
         "--block-size", cfg["block_size"],
         "--sample-from-anchor" if cfg["sample_from_anchor"] else "--no-sample-from-anchor",
         "--dflash-decay-gamma", cfg["dflash_decay_gamma"],
         "--per-position-loss-weight", cfg["per_position_loss_weight"], "--dpace-alpha", cfg["dpace_alpha"]]
    if cfg["draft_vocab_size"] is not None:
        a += ["--draft-vocab-size", cfg["draft_vocab_size"],  # its mapping, from the same frequencies as dspark's
              "--token-freq-path", Path(cfg["data_path"]) / "token_freq.pt"]
    if dspark_kind:
        with_markov = cfg["confidence_head_with_markov"] and cfg["enable_confidence_head"]
        a += ["--markov-rank", cfg["markov_rank"], "--markov-head-type", cfg["markov_head_type"],
              "--enable-confidence-head" if cfg["enable_confidence_head"] else "--no-enable-confidence-head",
              "--confidence-head-with-markov" if with_markov else "--no-confidence-head-with-markov",
              "--confidence-head-alpha", cfg["confidence_head_alpha"]]
    return [str(x) for x in a]


def unmatched(cfg: dict, child: dict, dspark_epoch: int, ratio: float, cuda: bool) -> tuple[list[str], list[str]]:
    """(what differs between the two trainings, what was done to run them alike)."""
    import torch

    from dspark.train.muon import ns_dtype_for

    dev = torch.device("cuda" if cuda else "cpu")
    ns = ns_dtype_for(cfg["muon_ns_dtype"], dev)
    notes = [
        f"batches: the same training samples each epoch, packed differently: dspark packs a seeded permutation "
        f"greedily into {cfg['total_seq_len']}-token batches ({dspark_epoch} per epoch), speculators' "
        f"MultipackDistributedBatchSamplerV2 bins them its own way ({child.get('batches_per_epoch')} per epoch); "
        "so step k sees other samples in each",
        "lr warm-up: transformers' schedule starts at 0 (step/warmup), dspark's at 1/warmup ((step+1)/warmup); "
        "total schedule steps set equal (dspark's, over all epochs)",
        "random streams: the same --seed, but model init, anchor sampling and data order draw from each trainer's "
        "own sequence of RNG calls; initial weights are not checked to be identical",
        "data reading: dspark keeps decoded samples in memory (--keep-in-memory-gib) and reads with threads; "
        f"speculators reads one safetensors file per sample with {cfg['num_workers']} spawned DataLoader workers "
        "(seconds per step only)",
        "validation during training: dspark validates (with state-gain scoring) at each --checkpoint-freq, "
        "speculators at each epoch end; neither is in the eval below, and the median step time skips them",
        "checkpoint precision: speculators saves bf16 weights (its checkpointer's default); eval scores them "
        "upcast to fp32, as dspark's fp32 weights are scored",
    ]
    if cfg["optimizer"] == "muon" and ns != torch.bfloat16:
        notes.append(f"Muon Newton-Schulz dtype: speculators uses torch.optim.Muon (always bf16); dspark "
                     f"--muon-ns-dtype {cfg['muon_ns_dtype']} resolves to {str(ns).replace('torch.', '')} here")
    if cfg["scheduler_type"] == "none":
        notes.append("scheduler none: speculators has no warm-up at all, dspark warms up then holds")
    if cfg["max_grad_norm"] != 1.0:
        notes.append(f"gradient clipping: speculators clips at 1.0 (hard-coded), dspark at {cfg['max_grad_norm']}")
    split = child.get("muon_split") or {}
    for side in ("dspark", "speculators"):
        names = split.get(f"muon_in_{side}_only")
        if names:
            notes.append(f"Muon parameter split: only {side} puts {', '.join(names)} on Muon (the other: AdamW)")
    done = [f"split: the same samples (export rows ordered train then validation; speculators "
            f"--train-data-ratio {ratio:.6f} for dspark's {cfg['train_data_ratio']})",
            "log_freq: 1 for both (a time per step), not the config's"]
    done += [f"speculators patched in its own process: {p}" for p in child.get("patches", [])]
    return notes, done


def speculators_checkpoint_for_eval(save: Path, dspark_run: Path, eval_run: Path) -> Path:
    """Its last epoch's checkpoint, upcast to fp32, in a folder whose run record is the dspark run's (so that eval
    takes the same split, packing and anchors)."""
    import torch
    from safetensors.torch import load_file, save_file

    epochs = sorted((int(p.name), p) for p in save.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit())
    if not epochs:
        sys.exit(f"speculators saved no checkpoint in {save}")
    src = epochs[-1][1]
    if eval_run.exists():
        shutil.rmtree(eval_run)
    dst = eval_run / "checkpoints" / "final"
    dst.mkdir(parents=True)
    shutil.copy(dspark_run / "config.json", eval_run / "config.json")
    weights = load_file(str(src / "model.safetensors"))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for k in ("dtype", "torch_dtype"):
        if k in config:
            config[k] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def same_vocab_map(a: Path, b: Path) -> bool | None:
    """Whether two checkpoints hold the same draft-to-verifier token map (None: neither has one)."""
    from safetensors import safe_open

    maps = []
    for ckpt in (a, b):
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            maps.append(f.get_tensor("d2t") if "d2t" in f.keys() else None)
    if maps[0] is None and maps[1] is None:
        return None
    return maps[0] is not None and maps[1] is not None and bool((maps[0] == maps[1]).all())


def dspark_timing(run: Path) -> list[float]:
    """`train_s` of every logged training step (log_freq 1: each step)."""
    times = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") == "train" and "timing" in rec:
            times.append(rec["timing"]["train_s"])
    return times


def table(results: dict) -> str:
    names = [n for n in ("speculators", "dspark") if n in results["trainers"]]
    t = results["trainers"]
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    flags = f" {results['train_flags']}" if results["train_flags"] else ""
    lines = [f"Store {results['store']}, {results['steps']} steps, seed {results['seed']}, config "
             f"{results['config']}{flags}; "
             f"`dspark eval` on the dspark run's validation split ({t[names[0]]['eval']['anchors']['scored']} blocks, "
             f"--anchor-seed {t[names[0]]['eval']['anchors']['seed']}); {results['device']}.", "",
             "| trainer | steps | tau greedy | tau 1-TV | state gain pos 1 | state gain tau | s/step (median) "
             "| s/step (mean) | others' CPU share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        e, s = t[n]["eval"], t[n]["seconds_per_step"]
        g = e.get("state_gain") or {}
        lines.append(f"| {n} | {t[n]['steps_run']} | {e['tau_greedy']:.3f} | {e['tau_analytic']:.3f} | "
                     f"{fmt((g.get('positions') or [None])[0], '{:+.3f}')} | {fmt(g.get('tau_greedy'), '{:+.3f}')} | "
                     f"{fmt(s['median'])} | {fmt(s['mean'])} | {t[n]['others_cpu_share']:.0%} |")
    positions = [p["position"] for p in t[names[0]]["eval"]["positions"]]
    lines += ["", "| position | " + " | ".join(f"{n} greedy match" for n in names) + " |",
              "|---:|" + "---:|" * len(names)]
    for k in positions:
        lines.append(f"| {k} | " + " | ".join(f"{t[n]['eval']['positions'][k - 1]['greedy_match']:.3f}" for n in names)
                     + " |")
    lines += ["", "Not matched between the two trainers:", ""] + [f"- {u}" for u in results["unmatched"]]
    lines += ["", "Done to run them alike:", ""] + [f"- {u}" for u in results["aligned"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        return run_speculators_child(sys.argv[2], sys.argv[4:] if sys.argv[3] == "--" else sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="dspark Zarr store")
    p.add_argument("--data-path", required=True, help="its prepared folder")
    p.add_argument("--verifier-name-or-path", required=True)
    p.add_argument("--config", required=True, help="a `dspark train --config` file")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-flags", default="", help="more `dspark train` flags over the config, e.g. "
                   "'--epochs 1 --checkpoint-freq 0.25' (both trainers get the resolved settings)")
    p.add_argument("--output", help="default: cache/side_by_side/<store>-steps<N>-seed<S>")
    p.add_argument("--max-anchors", type=int, help="`dspark eval --max-anchors` (default: eval's)")
    p.add_argument("--fresh", action="store_true", help="delete this output's earlier runs first (not the export)")
    args = p.parse_args()
    for name in ("store", "data_path", "config", "verifier_name_or_path"):  # a hub id stays as it is
        if Path(getattr(args, name)).exists():
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    name = f"{Path(args.store).name}-steps{args.steps}-seed{args.seed}"
    out = Path(args.output or ROOT / "cache" / "side_by_side" / name)
    dspark_run, spec_root = out / "dspark", out / "speculators"
    for d in (dspark_run, spec_root, out / "eval"):
        if d.exists():
            if not args.fresh:
                sys.exit(f"{d} exists (an earlier run): pass --fresh to start over, or another --output")
            shutil.rmtree(d)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoConfig

    from dspark.connector.base import open_store
    from dspark.data.prepare import PreparedData
    from dspark.train.data import TrainData
    from dspark.train.model import mask_token_id
    from dspark.train.config import TrainConfig

    cfg, dspark_flags = resolve_settings(args, dspark_run)
    if cfg["speculator_type"] not in KINDS_SUPPORTED:
        sys.exit(f"--config trains {cfg['speculator_type']}: this comparison scores block drafters "
                 f"({', '.join(KINDS_SUPPORTED)}) with `dspark eval`")
    if cfg["source"] != "zarr":
        sys.exit("--config reads hidden states live: this comparison needs a store (--from zarr)")
    cuda = cfg["device"] in ("auto", "cuda") and torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores, OMP_NUM_THREADS=" \
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}"
    prepared = PreparedData(cfg["data_path"])
    data = TrainData(open_store(cfg["store"], "zarr"), prepared, cfg["total_seq_len"], cfg["train_data_ratio"],
                     cfg["seed"], "skip", cfg["verifier_name_or_path"], layers=cfg["target_layer_ids"])
    per_epoch = len(data.epoch_batches(0))
    total_steps = sum(len(data.epoch_batches(e)) for e in range(cfg["epochs"]))
    exported = export(cfg, data, prepared, out / "export")
    data.source.close()
    mask_token = mask_token_id(TrainConfig.from_dict(cfg))
    vcfg = AutoConfig.from_pretrained(cfg["verifier_name_or_path"])
    vcfg = getattr(vcfg, "text_config", vcfg)
    hidden_act = getattr(vcfg, "hidden_act", None) or getattr(vcfg, "hidden_activation", "silu")

    results: dict = {"store": args.store, "data_path": args.data_path, "verifier": args.verifier_name_or_path,
                     "config": args.config, "train_flags": args.train_flags, "steps": args.steps, "seed": args.seed,
                     "device": device,
                     "settings": cfg, "export": exported, "dspark_steps_per_epoch": per_epoch,
                     "dspark_total_steps": total_steps, "trainers": {}}

    # speculators first, then dspark: each arm's others' CPU share is reported with it
    mark = load_mark()
    spec_save = spec_root / "checkpoints"
    spec_save.mkdir(parents=True)
    ratio = (len(data.train_ids) + 0.5) / exported["rows"]
    spec_args = speculators_args(cfg, args, out / "export", spec_save, len(data.train_ids), exported["rows"],
                                 total_steps, mask_token, hidden_act, cuda)
    timings = spec_root / "timings.json"
    spec_wall = sh([sys.executable, Path(__file__).resolve(), CHILD, timings, "--", *spec_args],
                   out / "logs" / "speculators_train.log")
    child = json.loads(timings.read_text())
    results["trainers"]["speculators"] = {"command": ["python", "-m", "speculators.train", *spec_args],
                                          "wall_s": spec_wall, "steps_run": len(child["step_times"]),
                                          "seconds_per_step": step_seconds(child["step_times"]),
                                          "others_cpu_share": others_cpu_share(mark)}
    mark = load_mark()
    dspark_cmd = [ROOT / ".venv/bin/dspark", "train", *dspark_flags, "--no-progress"]
    dspark_wall = sh(dspark_cmd, out / "logs" / "dspark_train.log")
    steps = dspark_timing(dspark_run)
    results["trainers"]["dspark"] = {"command": ["dspark", *map(str, dspark_cmd[1:])], "wall_s": dspark_wall,
                                     "steps_run": len(steps), "seconds_per_step": step_seconds(steps),
                                     "others_cpu_share": others_cpu_share(mark)}

    ckpts = {"dspark": dspark_run / "latest",
             "speculators": speculators_checkpoint_for_eval(spec_save, dspark_run, spec_root / "eval-run")}
    for name, ckpt in ckpts.items():
        dst = out / "eval" / name
        cmd = [ROOT / ".venv/bin/dspark", "eval", "--checkpoint", ckpt, "--verifier-name-or-path",
               args.verifier_name_or_path, "--output", dst, "--no-progress"]
        if args.max_anchors is not None:
            cmd += ["--max-anchors", args.max_anchors]
        sh(cmd, out / "logs" / f"eval_{name}.log")
        results["trainers"][name]["checkpoint"] = str(ckpt)
        results["trainers"][name]["eval"] = json.loads((dst / "eval.json").read_text())

    results["unmatched"], results["aligned"] = unmatched(cfg, child, per_epoch, ratio, cuda)
    same = same_vocab_map(ckpts["dspark"].resolve(), ckpts["speculators"])
    if same is not None:
        (results["aligned"] if same else results["unmatched"]).append(
            f"draft vocabulary: both built from {cfg['data_path']}/token_freq.pt; the checkpoints' d2t maps are "
            + ("identical" if same else "different"))
    md = table(results)
    (out / "side_by_side.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "side_by_side.md").write_text(md)
    print("\n" + md + f"\n{out / 'side_by_side.json'}, {out / 'side_by_side.md'}")


if __name__ == "__main__":
    main()
