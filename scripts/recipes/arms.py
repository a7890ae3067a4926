"""Acceptance per CPU-hour, measured before scaled: training settings side by side on one store and one budget.

Each arm is the recipe's main run (`RECIPE/runs/original`: its store, data, verifier and every setting of
its record) with a few settings changed, trained for the same epochs (one schedule, every token seen as
often), then scored by `dspark eval` on the run's own validation split (tau, per-position greedy match,
the state gain: never a reported set). The main run itself is the `seed` arm. Resumable: an arm whose
eval.json exists is read, not run again; train resumes a killed run. Reports figures; asserts nothing.

    .venv/bin/python scripts/recipes/arms.py --recipe /work/dspark-cache/recipes/smollm2-scale \
        --arms layers3-dpace,layers2-dpace-anchors256,layers2-dpace-vocab16k

Writes RECIPE/arms/arms.json and arms.md (the table docs/results.md carries).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DPACE = ["--loss-fn", "ce", "--per-position-loss-weight", "dpace"]
WINNER = ["--num-layers", "2", *DPACE]  # the recipe's default since the first arms (smollm2.yaml)

# arm -> the settings it changes (flags of `dspark train`), and what it tests
ARMS = {
    "seed": ([], "the main run's settings: CE 0.1 + TV 0.9, exponential position decay, 1 layer"),
    "dpace": (DPACE, "CE with D-PACE position weights (speculators' DFlash default after 0.9, PR 980)"),
    "lk": (["--loss-fn", "lk_hybrid"], "LK hybrid loss (speculators 0.9)"),
    "ce": (["--loss-fn", "ce"], "CE alone, exponential position decay"),
    "layers2": (["--num-layers", "2"], "2 draft layers"),
    "layers3": (["--num-layers", "3"], "3 draft layers"),
    "anchors256": (["--max-anchors", "256"], "256 anchors per 2K-token batch (128 in the seed)"),
    "vocab16k": (["--draft-vocab-size", "16384"], "draft vocabulary 16K (8K in the seed)"),
    "lr1e-2": (["--lr", "1e-2"], "3.3x the seed's learning rate"),
    # the leading loss on the leading depth: do they add up?
    "layers2-dpace": (WINNER, "2 draft layers, CE with D-PACE"),
    "layers2-lk": (["--num-layers", "2", "--loss-fn", "lk_hybrid"], "2 draft layers, LK hybrid loss"),
    # one more change to the winner: does it still pay on top?
    "layers3-dpace": (["--num-layers", "3", *DPACE], "3 draft layers, CE with D-PACE"),
    "layers2-dpace-anchors256": ([*WINNER, "--max-anchors", "256"], "the winner with 256 anchors per batch"),
    "layers2-dpace-vocab16k": ([*WINNER, "--draft-vocab-size", "16384"], "the winner with a 16K draft vocabulary"),
    "layers2-dpace-lr1e-2": ([*WINNER, "--lr", "1e-2"], "the winner at 3.3x the learning rate"),
}


def run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


# the record's settings that are the run's places and schedule, not its training settings
PLACES = {"data_path", "save_path", "store", "source", "live", "tracking", "verifier_name_or_path", "epochs",
          "checkpoint_freq"}


def seed_settings(recipe: Path, record: dict) -> Path:
    """The main run's training settings as a config file: arms stay its variations after the recipe's defaults
    move on (smollm2.yaml takes the winner)."""
    path = recipe / "arms" / "seed.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in record.items() if k not in PLACES}, indent=2))  # JSON is YAML
    return path


def arm(recipe: Path, name: str, record: dict, dspark: str, config: Path) -> dict:
    main = recipe / "runs" / "original"
    folder = main if name == "seed" else recipe / "arms" / name
    evaluated = folder / "latest" / "eval" / "eval.json"
    if not evaluated.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        log = recipe / "arms" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if name != "seed":
            run([dspark, "train", "--config", str(config), "--from", "zarr", "--store", record["store"],
                 "--data-path", record["data_path"], "--verifier-name-or-path", record["verifier_name_or_path"],
                 "--save-path", str(folder), "--epochs", str(record["epochs"]),
                 "--checkpoint-freq", str(record["checkpoint_freq"]), "--no-progress", *ARMS[name][0]], log)
        run([dspark, "eval", "--checkpoint", str(folder / "latest"), "--no-progress"], log)
    from dspark.decode.compare import training_record

    steps, seconds = training_record((folder / "latest").resolve())
    ev = json.loads(evaluated.read_text())
    first = ev["positions"][0]
    gain = ev.get("state_gain") or {}
    return {"arm": name, "what": ARMS[name][1], "flags": ARMS[name][0], "steps": steps, "train_s": seconds,
            "tau_greedy": ev["tau_greedy"], "tau_analytic": ev["tau_analytic"], "pos1": first["greedy_match"],
            "pos2": ev["positions"][1]["greedy_match"] if len(ev["positions"]) > 1 else None,
            "state_gain_pos1": (gain.get("positions") or [None])[0], "blocks": ev.get("blocks")}


def markdown(rows: list[dict], record: dict) -> str:
    out = [f"Arms on one store ({record['store']}), {rows[0]['steps']} steps each (one epoch of the same cosine "
           "schedule), scored on each run's validation split by `dspark eval` (2 CPU cores):", "",
           "| arm | what it changes | validation tau (greedy) | tau (analytic) | pos 1 | pos 2 | state gain pos 1 | "
           "training min | tau gain per CPU-hour |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hours = (r["train_s"] or 0) / 3600
        minutes = "-" if r["train_s"] is None else f"{r['train_s'] / 60:.1f}"
        per_hour = "-" if not hours else f"{(r['tau_greedy'] - 1) / hours:.2f}"
        pos2 = "-" if r["pos2"] is None else f"{r['pos2']:.3f}"
        gain = "-" if r["state_gain_pos1"] is None else f"{r['state_gain_pos1']:+.3f}"
        out.append(f"| {r['arm']} | {r['what']} | {r['tau_greedy']:.3f} | {r['tau_analytic']:.3f} | {r['pos1']:.3f} | "
                   f"{pos2} | {gain} | {minutes} | {per_hour} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, required=True, help="the recipe's folder (RECIPE of smollm2.sh)")
    ap.add_argument("--arms", default="dpace,lk,layers2,layers3,anchors256,vocab16k",
                    help=f"comma-separated, of {', '.join(ARMS)} (seed always runs first; '' only tabulates the "
                         "arms evaluated so far)")
    ap.add_argument("--dspark", default=".venv/bin/dspark")
    a = ap.parse_args()
    names = ["seed", *[n for n in a.arms.split(",") if n and n != "seed"]]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        sys.exit(f"error: unknown arm(s) {unknown} (fix: use some of {list(ARMS)})")
    # the table holds every arm evaluated so far, not only this call's
    names += [n for n in ARMS if n not in names and (a.recipe / "arms" / n / "latest" / "eval" / "eval.json").exists()]
    record = json.loads((a.recipe / "runs" / "original" / "config.json").read_text())["train"]  # the run record
    rows, settings = [], seed_settings(a.recipe, record)
    for name in names:
        t = time.time()
        rows.append(arm(a.recipe, name, record, a.dspark, settings))
        print(f"{name}: tau {rows[-1]['tau_greedy']:.3f}, state gain {rows[-1]['state_gain_pos1']:+.3f} "
              f"({time.time() - t:.0f} s)", flush=True)
        out = a.recipe / "arms"  # made by seed_settings
        (out / "arms.json").write_text(json.dumps(rows, indent=2))
        (out / "arms.md").write_text(markdown(rows, record))
    print(markdown(rows, record))


if __name__ == "__main__":
    main()
