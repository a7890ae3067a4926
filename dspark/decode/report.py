"""Decoded acceptance as users read it: per-position rates per dataset and per sub-domain (MT-bench
category, LongBench dataset), long-context buckets, a PNG.

Counts follow vLLM's spec-decode counters: a *draft* is one verifier step; position k is
accepted in a step when at least k drafts were; the per-position rate is accepted / drafts
(vLLM's `num_accepted_tokens_per_pos / num_drafts`), the conditional rate divides by the
steps that reached position k; the mean acceptance length counts the verifier's own token too.
A step without drafts (prompt lookup finding no match, a confidence cut at 0) is not a draft
to vLLM: `drafted_steps` and `mean_acceptance_length_drafted` count as vLLM does, while
`drafts` and `mean_acceptance_length` count every verifier step, the tokens a forward yields.

A mean length measured on a few prompts is noisy, and its steps are not independent (a prompt that
the drafter finds easy gives many long steps): `mean_acceptance_length_se` is its standard error
with requests as the sampling unit, and `difference` compares two drafters decoded on the same
prompts, pairing each prompt with itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from dspark.decode import cost
from dspark.decode.loop import Trace
from dspark.core.report import save_figure

BEYOND = "beyond the verifier's maximum length"


def _linearized(per_request: list[list[int]]) -> np.ndarray | None:
    """Each request's share of the error of the mean acceptance length, (accepted - rate * steps) / all steps:
    the delta method for a ratio of sums over requests (None where the ratio is undefined)."""
    steps, accepted = np.array(per_request, dtype=np.float64).reshape(-1, 2).T
    if steps.sum() == 0:
        return None
    return (accepted - accepted.sum() / steps.sum() * steps) / steps.sum()


def _se(z: np.ndarray | None) -> float | None:
    n = 0 if z is None else len(z)
    return float(np.sqrt(n / (n - 1) * (z ** 2).sum())) if n > 1 else None


def difference(a: dict, b: dict) -> tuple[float, float | None]:
    """Mean acceptance length of summary `a` minus `b`'s (the same prompts, in the same order), and the
    standard error of that difference with each prompt paired with itself (None: fewer than 2 prompts)."""
    if len(a["per_request"]) != len(b["per_request"]):
        raise ValueError(f"paired over different prompts: {len(a['per_request'])} and {len(b['per_request'])}")
    za, zb = _linearized(a["per_request"]), _linearized(b["per_request"])
    delta = a["mean_acceptance_length"] - b["mean_acceptance_length"]
    return delta, None if za is None or zb is None else _se(za - zb)


def summarize(traces: list[Trace], n_spec: int) -> dict:
    accepted = np.array([a for t in traces for a in t.accepted], dtype=np.int64)
    verified = np.array([v for t in traces for v in t.verified], dtype=np.int64)
    steps = len(accepted)
    at = [int((accepted >= k).sum()) for k in range(1, n_spec + 1)]
    drafted = [int((verified >= k).sum()) for k in range(1, n_spec + 1)]
    reached = [steps, *at[:-1]]
    draft_s, verify_s = sum(t.draft_s for t in traces), sum(t.verify_s for t in traces)
    tokens, seconds = sum(len(t.tokens) for t in traces), sum(t.seconds for t in traces)
    per_request = [[len(t.accepted), sum(t.accepted)] for t in traces]
    return {
        "requests": len(traces), "drafts": steps, "draft_tokens": int(verified.sum()),
        "accepted_tokens": int(accepted.sum()), "tokens": tokens,
        "mean_acceptance_length": 1 + float(accepted.sum()) / max(steps, 1),
        "mean_acceptance_length_se": _se(_linearized(per_request)),
        "per_request": per_request,  # [verifier steps, accepted drafts] per request, in order
        "drafted_steps": int((verified > 0).sum()),
        "mean_acceptance_length_drafted": 1 + float(accepted.sum()) / max(int((verified > 0).sum()), 1),
        "positions": [{"position": k + 1, "drafted": drafted[k], "accepted": at[k],
                       "rate": at[k] / max(steps, 1), "conditional": at[k] / max(reached[k], 1)}
                      for k in range(n_spec)],
        "accepted_length_histogram": np.bincount(accepted, minlength=n_spec + 1).tolist(),
        "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
        "draft_s": draft_s, "verify_s": verify_s, "prefill_s": sum(t.prefill_s for t in traces),
        "ms_per_draft": 1000 * draft_s / max(steps, 1), "ms_per_verify": 1000 * verify_s / max(steps, 1),
        "drafted_tokens_per_s": float(verified.sum()) / draft_s if draft_s else 0.0,
        "verified_tokens_per_s": float(verified.sum() + steps) / verify_s if verify_s else 0.0,
    }


def reach_rates(traces: list[Trace], n: int) -> list[float]:
    """Per position i = 1..n, the share of steps whose first i drafts were all accepted: `summarize`'s per-position
    rate (steps without drafts count as none accepted, as a fixed k would see them). What decode/cost.py's best fixed
    k is chosen from."""
    return [p["rate"] for p in summarize(traces, n)["positions"]]


def by_subdomain(traces: Iterable[tuple[str | None, Trace]], n_spec: int) -> dict[str, dict]:
    """`summarize` per sub-domain ("-" for prompts without one), in the order sub-domains first appear."""
    groups: dict[str, list[Trace]] = {}
    for sub, trace in traces:
        groups.setdefault("-" if sub is None else sub, []).append(trace)
    return {sub: summarize(ts, n_spec) for sub, ts in groups.items()}


def tracked(result: dict) -> dict[str, float]:
    """The figures a tracker charts per checkpoint: per set, mean acceptance length, per-position acceptance,
    speedup and tokens/s, with confidence cuts and per sub-domain (MT-bench categories) where decoded."""
    out = {}
    for d in result["datasets"]:
        pre, s = f"eval/decode/{d['name']}", d["decoded"]
        out.update({f"{pre}/mean_acceptance_length": s["mean_acceptance_length"], f"{pre}/speedup": d["speedup"],
                    f"{pre}/tokens_per_s": s["tokens_per_s"]})
        out.update({f"{pre}/position_{p['position']}_rate": p["rate"] for p in s["positions"]})
        for label, v in d.get("verification", {}).items():
            key = label.replace(" ", "_").replace("-", "_")
            out.update({f"{pre}/{key}/mean_acceptance_length": v["mean_acceptance_length"],
                        f"{pre}/{key}/speedup": v["speedup"]})
        out.update({f"{pre}/{sub}/mean_acceptance_length": v["mean_acceptance_length"]
                    for sub, v in d["by_subdomain"].items()})
    return out


def _rates(s: dict) -> str:
    return " | ".join(f"{p['rate']:.3f}" for p in s["positions"])


def markdown(result: dict) -> str:
    n = result["num_speculative_tokens"]
    pos = " | ".join(str(k) for k in range(1, n + 1))
    head = (f"Decoded with {result['layout']} layout, {result['num_speculative_tokens']} draft tokens per step, "
            f"{result['sampling']}, up to {result['max_new_tokens']} new tokens per prompt.")
    lines = [head, "", "Per-position acceptance rate (accepted / drafts), mean acceptance length (incl. the "
             "verifier's token) and wall-clock speedup over the verifier alone:", "",
             f"| dataset | prompts | drafts | {pos} | mean length | tok/s | verifier-only tok/s | speedup |",
             "|---|---:|---:|" + "---:|" * n + "---:|---:|---:|---:|"]
    for d in result["datasets"]:
        s = d["decoded"]
        lines.append(f"| {d['name']} | {s['requests']} | {s['drafts']} | {_rates(s)} | "
                     f"{s['mean_acceptance_length']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{d['verifier_only']['tokens_per_s']:.1f} | {d['speedup']:.2f}x |")
    split = [d for d in result["datasets"] if d.get("by_subdomain")]
    if split:
        lines += ["", "Per sub-domain (MT-bench category, LongBench dataset): per-position acceptance rate and mean "
                  "acceptance length:", "", f"| dataset | sub-domain | prompts | drafts | {pos} | mean length |",
                  "|---|---|---:|---:|" + "---:|" * n + "---:|"]
        for d in split:
            lines += [f"| {d['name']} | {sub} | {s['requests']} | {s['drafts']} | {_rates(s)} | "
                      f"{s['mean_acceptance_length']:.2f} |" for sub, s in d["by_subdomain"].items()]
    lines += ["", "Where the time goes (per verifier step, the prompt's forward left out): the speedup to expect is "
              "the mean length times the verifier's cost per token alone, over the drafter's and the verifier's "
              "cost per step.", "",
              f"| dataset | drafter ms/step | verifier ms/step ({n + 1} tokens) | verifier ms/token alone | "
              "expected speedup | measured |", "|---|---:|---:|---:|---:|---:|"]
    for d in result["datasets"]:
        s, alone = d["decoded"], d["verifier_only"]["ms_per_token"]
        expected = s["mean_acceptance_length"] * alone / max(s["ms_per_draft"] + s["ms_per_verify"], 1e-9)
        lines.append(f"| {d['name']} | {s['ms_per_draft']:.1f} | {s['ms_per_verify']:.1f} | {alone:.1f} | "
                     f"{expected:.2f}x | {d['speedup']:.2f}x |")
    lines += verification_lines(result)
    if result.get("long_context"):
        lines += ["", "Long context: mean acceptance length by sub-domain and prompt length (tokens):", ""]
        buckets = result["long_buckets"]
        lines += ["| dataset | sub-domain | " + " | ".join(buckets) + " |", "|---|---|" + "---|" * len(buckets)]
        for row in result["long_context"]:
            cells = [row["cells"].get(b, "") for b in buckets]
            lines.append(f"| {row['dataset']} | {row['subdomain']} | " + " | ".join(cells) + " |")
    tf = result.get("teacher_forced")
    if tf:
        lines += ["", "Teacher-forced estimate (`dspark eval` on stored states) next to real decoding:", "",
                  "| | mean acceptance length |", "|---|---:|",
                  f"| teacher-forced, greedy match (tau greedy) | {tf['tau_greedy']:.2f} |",
                  f"| teacher-forced, analytic 1-TV (tau analytic) | {tf['tau_analytic']:.2f} |"]
        lines += [f"| decoded, {d['name']} | {d['decoded']['mean_acceptance_length']:.2f} |" for d in result["datasets"]]
    return "\n".join(lines) + "\n"


def profile_lines(profile: dict | None) -> list[str]:
    """The measured costs as a table: the verifier's forward over k tokens per profiled context, each drafter's
    proposal."""
    if not profile:
        return []
    ks = range(1, len(profile["check_ms"][0]) + 1)
    lines = ["", f"Measured on this machine before decoding (median of {profile['repeats']}; {profile['seconds']:.0f} s): "
             "the verifier's forward over k tokens (the anchor and k - 1 drafts), in ms, per context length:", "",
             "| context | " + " | ".join(str(k) for k in ks) + " |", "|---:|" + "---:|" * len(ks)]
    for c, row in zip(profile["contexts"], profile["check_ms"]):
        lines.append(f"| {c} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    lines += ["", "| drafter | ms per proposal |", "|---|---|"]
    for name, ms in profile["draft_ms"].items():
        per = f"{ms[0]:.1f}" if len(ms) == 1 else ", ".join(f"{x:.1f}" for x in ms) + " (1, 2, ... drafts)"
        lines.append(f"| {name} | {per} |")
    return lines


def verification_lines(result: dict) -> list[str]:
    """Fixed N, the best fixed k and cost-driven verification side by side per set; the confidence head's
    calibration; the draft count recommended for serving."""
    sets = [d for d in result["datasets"] if d.get("verification")]
    if not sets or len(sets[0]["verification"]) < 2:
        return []
    lines = profile_lines(result.get("cost_profile"))
    chosen = result.get("calibration")
    if chosen:
        k = chosen["k"][next(iter(chosen["k"]))]
        lines += ["", f"The best fixed k ({k}{': the verifier alone' if k == 0 else ''}) maximises the expected tokens "
                  f"per second with the acceptance measured on {chosen['set']['prompts']} calibration prompts "
                  f"({chosen['set']['name']}, never a reported set) at {chosen['context']} tokens of context."
                  + (" Cost-driven verification chooses per step from the confidence head (vLLM's adaptive "
                     "verification, with these costs)." if cost.CostDriven.label in sets[0]["verification"] else "")]
    lines += ["", "| dataset | verification | mean length | drafts verified/step | tok/s | speedup |",
              "|---|---|---:|---:|---:|---:|"]
    for d in sets:
        for label, v in d["verification"].items():
            lines.append(f"| {d['name']} | {label} | {v['mean_acceptance_length']:.2f} | {v['verified_per_step']:.2f} | "
                         f"{v['tokens_per_s']:.1f} | {v['speedup']:.2f}x |")
    cal = [d for d in sets if d.get("confidence_calibration")]
    if cal:
        lines += ["", "The confidence head against the verifier (fixed N): predicted survival (running product of its "
                  "confidences, mean over steps) against the share of steps accepting that far, and its output against "
                  "the share accepted among the steps that reached the position:", "",
                  "| dataset | position | predicted survival | observed | predicted conditional | observed |",
                  "|---|---:|---:|---:|---:|---:|"]
        for d in cal:
            for r in d["confidence_calibration"]:
                if r["position"] > 1 and max(r["predicted_survival"], r["observed_survival"]) < 0.005:
                    break  # the rest is nothing against nothing
                lines.append(f"| {d['name']} | {r['position']} | {r['predicted_survival']:.3f} | "
                             f"{r['observed_survival']:.3f} | {_cell(r['predicted_conditional'])} | "
                             f"{_cell(r['observed_conditional'])} |")
    rec = result.get("recommendation")
    if rec:
        flag = ", enable_adaptive_verification: true" if rec.get("enable_adaptive_verification") else ""
        lines += ["", f"**Serve with num_speculative_tokens {rec['num_speculative_tokens']}{flag}**: {rec['why']}."]
    return lines


def _cell(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def long_context_rows(sets: list[dict], buckets: list[str]) -> list[dict]:
    """One row per (dataset, sub-domain); a cell holds the mean length and prompts, or says it is beyond reach."""
    rows = []
    for d in sets:
        subs = sorted({s for s, _ in d["by_bucket"]} | {s for s, _ in d["too_long"]}, key=str)
        for sub in subs:
            cells = {}
            for b in buckets:
                if (sub, b) in d["by_bucket"]:
                    s = d["by_bucket"][(sub, b)]
                    cells[b] = f"{s['mean_acceptance_length']:.2f} ({s['requests']})"
                elif (sub, b) in d["too_long"]:
                    cells[b] = f"{BEYOND} ({d['too_long'][(sub, b)]})"
            rows.append({"dataset": d["name"], "subdomain": sub or "-", "cells": cells})
    return rows


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long_rows = result.get("long_context") or []
    fig, axes = plt.subplots(1, 2 if long_rows else 1, figsize=(11 if long_rows else 6, 4), squeeze=False)
    a = axes[0, 0]
    for i, d in enumerate(result["datasets"]):
        s = d["decoded"]
        a.plot([p["position"] for p in s["positions"]], [p["rate"] for p in s["positions"]], marker="o",
               color=f"C{i}", label=f"{d['name']} ({s['mean_acceptance_length']:.2f})")
        for label, style in ((cost.CostDriven.label, "--"), (cost.FixedK.label, ":")):
            c = d.get("verification", {}).get(label)
            if c:
                a.plot([p["position"] for p in c["positions"]], [p["rate"] for p in c["positions"]], linestyle=style,
                       marker=".", color=f"C{i}", label=f"{d['name']}, {label} ({c['mean_acceptance_length']:.2f})")
    a.set(xlabel="draft position", ylabel="acceptance rate (accepted / drafts)", ylim=(0, 1.02),
          title="decoded per-position acceptance (mean length)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    if long_rows:
        b = axes[0, 1]
        buckets = result["long_buckets"]
        x = np.arange(len(buckets))
        width = 0.8 / len(long_rows)
        for i, row in enumerate(long_rows):
            vals = [float(row["cells"][k].split()[0]) if k in row["cells"] and not row["cells"][k].startswith(BEYOND)
                    else np.nan for k in buckets]
            b.bar(x - 0.4 + width * (i + 0.5), vals, width, label=f"{row['dataset']}/{row['subdomain']}")
            for j, k in enumerate(buckets):
                if row["cells"].get(k, "").startswith(BEYOND):
                    b.text(x[j], 0.05, "beyond max length", rotation=90, fontsize=7, ha="center", va="bottom")
        b.set_xticks(x, buckets, fontsize=8)
        b.set(xlabel="prompt tokens", ylabel="mean acceptance length", title="long context")
        b.legend(fontsize=7)
        b.grid(alpha=0.3, axis="y")
    save_figure(fig, path, title)
