"""The training loop's overhead: its steps/s against the bare model step's, side by side in one process.

    OMP_NUM_THREADS=2 python scripts/bench_train.py                      # the demo's settings and data
    OMP_NUM_THREADS=2 python scripts/bench_train.py --ns-dtype bf16 fp32  # Muon's Newton-Schulz, before/after
    OMP_NUM_THREADS=2 python scripts/bench_train.py --set keep_in_memory_gib=0  # samples read every epoch

(A) bare: the model, optimizers and schedules from the project's builders (dspark/train/model.py),
    the same batches collated in memory beforehand, then per batch only forward + loss, backward,
    clipping, optimizer and scheduler steps: no loader, no logging, no validation, no checkpoint.
(B) loop: `dspark train`'s Trainer.fit() on the same config and data for the same number of steps
    (its setup, building the Trainer, is not timed): loader, metrics, logging, validation, checkpoints.

Arms alternate (A B, then B A, ...) --reps times per dtype; medians are printed, with the loop's time
waiting for data and its validation and save seconds per checkpoint. On a shared machine other
processes' load swamps the difference (a 2-thread step on 2 cores slows by 2-20x when a core is
taken), so each arm first waits (--quiet-wait) for the cores to be free, and the share of the
cores others used during each arm is printed with it. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    """CPU seconds every process on the machine has used (Linux /proc/stat), for telling a disturbed rep."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Others:
    """The share of the machine's cores that other processes used while an arm ran."""

    def __enter__(self):
        self.t, self.busy, self.mine = time.perf_counter(), busy_seconds(), time.process_time()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        others = busy_seconds() - self.busy - (time.process_time() - self.mine)
        self.share = max(0.0, others) / (wall * os.cpu_count())


def wait_quiet(max_wait: float, threshold: float = 0.1) -> None:
    """Wait (up to max_wait s) until other processes use under `threshold` of the cores for a second."""
    deadline = time.perf_counter() + max_wait
    while time.perf_counter() < deadline:
        with Others() as o:
            time.sleep(1.0)
        if o.share < threshold:
            return


def config(args):
    from dspark.train.config import TrainConfig

    data = yaml.safe_load(Path(args.config).read_text())
    data.update(data_path=args.data_path, store=args.store, verifier_name_or_path=args.verifier, source="zarr",
                save_path="unused",
                **{k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    return TrainConfig.from_dict(data, "bench_train.py").validate()


def preload(cfg, steps: int | None):
    """The first `steps` batches of the run's own plan, collated and on the device, and the run's step count."""
    from dspark.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(replace(cfg, save_path=tmp), progress=False)
        plan = [b for epoch in tr.epoch_plan for b in epoch][:steps]  # steps=None: the whole run
        batches = [tr.place(tr.data.collate([tr.data.read(i) for i in b])) for b in plan]
        tr.source.close()
        return [b for b in batches if b is not None], tr.total_steps, tr.device, tr.prepared


def bare(cfg, batches, total_steps, device, prepared) -> float:
    from dspark.train.loop import seed_everything
    from dspark.train.model import build_model, build_optimizers, build_schedulers, loss_kwargs
    from dspark.verifier.resolved import Verifier

    seed_everything(cfg.seed)
    model = build_model(cfg, prepared, device, Verifier.resolve(cfg.verifier_name_or_path))
    kw = loss_kwargs(model, cfg, device)
    opts = build_optimizers(model, cfg)
    scheds = build_schedulers(opts, cfg, total_steps)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start, cpu = time.perf_counter(), time.process_time()
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
    return time.perf_counter() - start, time.process_time() - cpu


def loop(cfg, steps: int) -> tuple[float, float, dict, int]:
    from dspark.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(replace(cfg, save_path=tmp, max_steps=steps), progress=False)
        start, cpu = time.perf_counter(), time.process_time()
        out = tr.fit()
        return time.perf_counter() - start, time.process_time() - cpu, tr.timing, out["steps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "scripts/configs/demo.yaml"))
    ap.add_argument("--store", default="cache/stores/demo")
    ap.add_argument("--data-path", default="cache/prepared/demo")
    ap.add_argument("--verifier", default="cache/models/tiny")
    ap.add_argument("--steps", type=int, default=None, help="Steps per arm (default: the whole run, every epoch).")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ns-dtype", nargs="+", default=["auto"], choices=["auto", "bf16", "fp32"],
                    help="Muon's Newton-Schulz dtype(s): each one is benchmarked, interleaved with the others.")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="Before each arm, wait up to this many seconds for other processes to leave the cores.")
    ap.add_argument("--quiet", type=float, default=0.1,
                    help="A rep counts as quiet when other processes used under this share of the cores.")
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
    batches, total_steps, device, prepared = preload(cfg, args.steps)
    print(f"{len(batches)} steps per arm, {args.reps} reps, torch threads {torch.get_num_threads()}, "
          f"config {args.config}", flush=True)
    for d in args.ns_dtype:  # warm-up, untimed: first-call costs (allocator, oneDNN kernels) hit no arm
        bare(replace(cfg, muon_ns_dtype=d), batches[:4], total_steps, device, prepared)
    keys = ("bare", "loop", "bare_cpu", "loop_cpu", "wait", "val", "save", "train_only", "bare_others", "loop_others",
            "read_all")
    res = {d: {k: [] for k in keys} for d in args.ns_dtype}
    for rep in range(args.reps):
        for d in args.ns_dtype:
            c, r = replace(cfg, muon_ns_dtype=d), res[d]
            for arm in (("bare", "loop") if rep % 2 == 0 else ("loop", "bare")):
                wait_quiet(args.quiet_wait)
                if arm == "bare":
                    with Others() as o:
                        secs, cpu = bare(c, batches, total_steps, device, prepared)
                    r["bare"].append(len(batches) / secs)
                    r["bare_cpu"].append(cpu / len(batches))
                else:
                    with Others() as o:
                        secs, cpu, t, n = loop(c, len(batches))
                    r["loop"].append(n / secs)
                    r["loop_cpu"].append(cpu / n)
                    data = t["data_wait_s"] + t.get("read_all_s", 0.0)
                    r["wait"].append(data / max(data + t["step_s"], 1e-9))
                    r["read_all"].append(t.get("read_all_s", 0.0))
                    r["val"].append(statistics.mean(t["validate_s"]) if t["validate_s"] else 0.0)
                    r["save"].append(statistics.mean(t["save_s"]) if t["save_s"] else 0.0)
                    r["train_only"].append(n / (secs - sum(t["validate_s"]) - sum(t["save_s"])))
                r[f"{arm}_others"].append(o.share)
            print(f"  rep {rep} ns={d}: bare {r['bare'][-1]:.2f} steps/s, loop {r['loop'][-1]:.2f} steps/s "
                  f"({r['bare'][-1] / r['loop'][-1]:.3f}x); other processes used {r['bare_others'][-1]:.0%} and "
                  f"{r['loop_others'][-1]:.0%} of the cores", flush=True)
    med = statistics.median
    print(f"""
Medians over the reps in which other processes used under {args.quiet:.0%} of the cores in both arms (all reps if
none). ratio: bare steps/s over loop steps/s, per rep; best: fastest bare over fastest loop; cpu: process CPU
seconds per step, loop over bare; no_val/save: the ratio without the loop's validation and save seconds;
data: the loop's time getting data (read_all_s: reading a store that fits in memory up front, then waits),
over that plus its steps'.""")
    print("ns_dtype  quiet  bare_steps/s  loop_steps/s  ratio  best   cpu    no_val/save  data   read_all_s  "
          "val_s/ckpt  save_s/ckpt")
    for d, r in res.items():
        quiet = [i for i in range(args.reps) if max(r["bare_others"][i], r["loop_others"][i]) < args.quiet]
        pick = quiet or list(range(args.reps))

        def m(key, fn=None):
            return med([r[key][i] if fn is None else fn(i) for i in pick])
        print(f"{d:8}  {len(quiet)}/{args.reps}    {m('bare'):12.2f}  {m('loop'):12.2f}  "
              f"{m('', lambda i: r['bare'][i] / r['loop'][i]):5.3f}  "
              f"{max(r['bare'][i] for i in pick) / max(r['loop'][i] for i in pick):5.3f}  "
              f"{m('', lambda i: r['loop_cpu'][i] / r['bare_cpu'][i]):5.3f}  "
              f"{m('', lambda i: r['bare'][i] / r['train_only'][i]):11.3f}  {m('wait'):5.1%}  {m('read_all'):10.3f}  "
              f"{m('val'):10.3f}  {m('save'):11.3f}")

if __name__ == "__main__":
    main()
