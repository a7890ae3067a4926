"""The training loop's overhead: its steps/s against the bare model step's, side by side in one process.

    OMP_NUM_THREADS=2 python scripts/bench_train.py                      # the demo's settings and data
    OMP_NUM_THREADS=2 python scripts/bench_train.py --ns-dtype bf16 fp32  # Muon's Newton-Schulz, before/after

(A) bare: the model, optimizers and schedules from the project's builders (dspark/train/model.py),
    the same batches collated in memory beforehand, then per batch only forward + loss, backward,
    clipping, optimizer and scheduler steps: no loader, no logging, no validation, no checkpoint.
(B) loop: `dspark train`'s Trainer.fit() on the same config and data for the same number of steps
    (its setup, building the Trainer, is not timed): loader, metrics, logging, validation, checkpoints.

Arms alternate (A B, then B A, ...) --reps times per dtype; medians are printed, with the loop's time
waiting for data and its validation and save seconds per checkpoint. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def config(args):
    from dspark.train.config import TrainConfig

    data = yaml.safe_load(Path(args.config).read_text())
    data.update(data_path=args.data_path, store=args.store, verifier_name_or_path=args.verifier, source="zarr",
                save_path="unused", **dict(kv.split("=", 1) for kv in args.set))
    return TrainConfig.from_dict(data, "bench_train.py").validate()


def preload(cfg, steps: int):
    """The first `steps` batches of the run's own plan, collated and on the device, and the run's step count."""
    from dspark.train.loop import Trainer, _to_device

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(replace(cfg, save_path=tmp), progress=False)
        plan = [b for epoch in tr.epoch_plan for b in epoch][:steps]
        batches = [_to_device(tr.data.collate([tr.data.read(i) for i in b]), tr.device) for b in plan]
        tr.source.close()
        return [b for b in batches if b is not None], tr.total_steps, tr.device, tr.prepared


def bare(cfg, batches, total_steps, device, prepared) -> float:
    from dspark.train.loop import seed_everything
    from dspark.train.model import build_model, build_optimizers, build_schedulers, loss_kwargs

    seed_everything(cfg.seed)
    model = build_model(cfg, prepared, device)
    kw = loss_kwargs(model, cfg, device)
    opts = build_optimizers(model, cfg)
    scheds = build_schedulers(opts, cfg, total_steps)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for batch in batches:
        with autocast:
            _, loss, _ = model(**batch, **kw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
    sync()
    return time.perf_counter() - start


def loop(cfg, steps: int) -> tuple[float, dict, int]:
    from dspark.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(replace(cfg, save_path=tmp, max_steps=steps), progress=False)
        start = time.perf_counter()
        out = tr.fit()
        return time.perf_counter() - start, tr.timing, out["steps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "scripts/configs/demo.yaml"))
    ap.add_argument("--store", default="cache/stores/demo")
    ap.add_argument("--data-path", default="cache/prepared/demo")
    ap.add_argument("--verifier", default="cache/models/tiny")
    ap.add_argument("--steps", type=int, default=None, help="Steps per arm (default: one epoch).")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ns-dtype", nargs="+", default=["auto"], choices=["auto", "bf16", "fp32"],
                    help="Muon's Newton-Schulz dtype(s): each one is benchmarked, interleaved with the others.")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Config overrides (strings, as in a YAML file), e.g. num_workers=1.")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    try:
        from loguru import logger

        logger.remove()
    except ImportError:
        pass
    cfg = config(args)
    steps = args.steps
    if steps is None:
        from dspark.prepare import PreparedData  # noqa: F401
        from dspark.train.loop import Trainer

        with tempfile.TemporaryDirectory() as tmp:
            probe = Trainer(replace(cfg, save_path=tmp), progress=False)
            steps = len(probe.epoch_plan[0])
            probe.source.close()
    batches, total_steps, device, prepared = preload(cfg, steps)
    print(f"{len(batches)} steps per arm, {args.reps} reps, torch threads {torch.get_num_threads()}, "
          f"config {args.config}", flush=True)
    res = {d: {"bare": [], "loop": [], "wait": [], "val": [], "save": []} for d in args.ns_dtype}
    for rep in range(args.reps):
        for d in args.ns_dtype:
            c = replace(cfg, muon_ns_dtype=d)
            for arm in (("bare", "loop") if rep % 2 == 0 else ("loop", "bare")):
                if arm == "bare":
                    res[d]["bare"].append(len(batches) / bare(c, batches, total_steps, device, prepared))
                else:
                    secs, timing, n = loop(c, len(batches))
                    r = res[d]
                    r["loop"].append(n / secs)
                    r["wait"].append(timing["data_wait_s"] / max(timing["data_wait_s"] + timing["step_s"], 1e-9))
                    r["val"].append(statistics.mean(timing["validate_s"]) if timing["validate_s"] else 0.0)
                    r["save"].append(statistics.mean(timing["save_s"]) if timing["save_s"] else 0.0)
            r = res[d]
            print(f"  rep {rep} ns={d}: bare {r['bare'][-1]:.2f} steps/s, loop {r['loop'][-1]:.2f} steps/s "
                  f"({r['bare'][-1] / r['loop'][-1]:.3f}x)", flush=True)
    med = statistics.median
    print("\nns_dtype  bare_steps/s  loop_steps/s  loop_time/bare_time  data_wait  val_s/ckpt  save_s/ckpt")
    for d, r in res.items():
        ratios = [b / lp for b, lp in zip(r["bare"], r["loop"])]
        print(f"{d:8}  {med(r['bare']):12.2f}  {med(r['loop']):12.2f}  {med(ratios):19.3f}  "
              f"{med(r['wait']):9.2%}  {med(r['val']):10.3f}  {med(r['save']):11.3f}")


if __name__ == "__main__":
    main()
