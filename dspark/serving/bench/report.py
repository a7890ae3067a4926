"""`dspark bench`'s tables and PNG, in the form of `dspark eval --decode`'s: per-position acceptance per set
(here from the server's counters), mean acceptance length, then what the users' clocks said."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.core.report import save_figure


def _ms(p: dict) -> str:
    return "-" if p["p50"] is None else f"{p['p50']:.0f} / {p['p90']:.0f} / {p['p99']:.0f}"


def _positions(result: dict) -> int:
    return max((len(r["spec"]["positions"]) for d in result["datasets"] for r in d["runs"] if r["spec"]), default=0)


def markdown(result: dict) -> str:
    cfg = result["config"]
    n = _positions(result)
    sampling = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    lines = [f"`dspark bench` against {result['endpoint']} (model {result['model']}): {cfg['api']} API, "
             f"{cfg['concurrency']} request(s) in flight, {cfg['max_tokens']} tokens per request, {sampling}"
             f"{', ignore_eos' if cfg['ignore_eos'] else ''}.", ""]
    for s in result["servers"]:
        kind = "speculative decoding" if s["speculative"] else "no speculative decoding"
        lines.append(f"- {s['label']}: {s['url']} ({kind})")
    pos = "".join(f" {k} |" for k in range(1, n + 1))
    lines += ["", "Acceptance counted by the server (vLLM's spec_decode counters, per-position rate = accepted at "
              "that position / drafts; mean length includes the verifier's own token) and what the client measured:",
              "", f"| set | server | prompts | drafts |{pos} mean length | output tok/s | TTFT ms p50/p90/p99 | "
                  "ITL ms p50/p90/p99 | speedup |",
              "|---|---|---:|---:|" + "---:|" * n + "---:|---:|---:|---:|---:|"]
    for d in result["datasets"]:
        for r in d["runs"]:
            spec = r["spec"]
            if spec is None:
                rates, drafts, mean = " - |" * n, "-", "no spec decode"
            else:
                rates = "".join(f" {p['rate']:.3f} |" for p in spec["positions"])
                rates += " - |" * (n - len(spec["positions"]))
                drafts = str(spec["drafts"])
                mean = f"{spec['mean_acceptance_length']:.2f}" if spec["drafts"] else "no drafts"
            speedup = d.get("speedup") if r["server"] == "endpoint" else None
            lines.append(f"| {d['name']} | {r['server']} | {r['requests']} | {drafts} |{rates} {mean} | "
                         f"{r['tokens_per_s']:.1f} | {_ms(r['ttft_ms'])} | {_ms(r['itl_ms'])} | "
                         f"{'-' if speedup is None else f'{speedup:.2f}x'} |")
    unsent = [(d["name"], r["server"], r["not_sent"]) for d in result["datasets"] for r in d["runs"] if r["not_sent"]]
    if unsent:
        lines += ["", "Not sent (--max-seconds reached): " + ", ".join(f"{n} of {s} to {w}" for s, w, n in unsent)]
    lines += ["", "ITL: gaps between streamed chunks (a chunk carries every token one verifier step accepted). "
              "Speedup: the endpoint's output tokens/s over the compared server's, same prompts."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, d in enumerate(result["datasets"]):
        for r, style in zip(d["runs"], ("-", "--")):
            spec = r["spec"]
            if spec and spec["drafts"]:
                a.plot([p["position"] for p in spec["positions"]], [p["rate"] for p in spec["positions"]],
                       linestyle=style, marker="o", color=f"C{i}",
                       label=f"{d['name']}, {r['server']} ({spec['mean_acceptance_length']:.2f})")
    a.set(xlabel="draft position", ylabel="acceptance rate (accepted / drafts)", ylim=(0, 1.02),
          title="served per-position acceptance (mean length)")
    if a.lines:
        a.legend(fontsize=7)
    a.grid(alpha=0.3)
    names = [d["name"] for d in result["datasets"]]
    labels = [s["label"] for s in result["servers"]]
    x, width = np.arange(len(names)), 0.8 / len(labels)
    for j, label in enumerate(labels):
        vals = [next(r["tokens_per_s"] for r in d["runs"] if r["server"] == label) for d in result["datasets"]]
        b.bar(x - 0.4 + width * (j + 0.5), vals, width, label=label)
    b.set_xticks(x, names, fontsize=8)
    b.set(ylabel="output tokens/s", title=f"throughput, {result['config']['concurrency']} in flight")
    b.legend(fontsize=7)
    b.grid(alpha=0.3, axis="y")
    save_figure(fig, path, title)
