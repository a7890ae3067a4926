"""What capturing and storing hidden states costs over each engine's bare forward.

    python scripts/bench_extract.py --model cache/models/tiny --data cache/prepared/demo [--repeats 5]
    .venv-vllm/bin/python scripts/bench_extract.py --engine vllm --model M --data PREPARED [--max-samples 200]

Same batches (as `dspark extract` plans them), arms interleaved, warm engines (startup and a
warm-up on other samples are not timed):
- transformers, in one process: `bare` runs the verifier's decoder stack over each batch, nothing
  captured or kept; `extract` is the transformers engine (layer hooks, per-sample states) writing
  every sample to a fresh Zarr store, closed at the end (everything durable).
- vllm, a fresh process per arm and repeat (one vLLM engine per process): `bare` is `vllm.LLM`
  prefilling each batch (max_tokens=1, no connector); `extract` is `dspark extract --engine vllm`'s
  engine (the extract_hidden_states method + our KV connector writing a Zarr store), timed until
  every sample is durable.
Prints each arm's min/median/max and the overhead of extract over bare: of the medians, and per
repeat, where the two arms ran back to back (their order alternates between repeats, so neither always
gets the warmer machine), which shows how much of a few percent is this machine's noise. `--json` also
writes them. Reports; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.connector.manifest import manifest_for_model
from dspark.connector.zarr.writer import ZarrSink
from dspark.extract.runner import plan_batches
from dspark.core.fsio import write_atomic
from dspark.core.jsonio import dump_json
from dspark.data.prepare import PreparedData
from dspark.verifier.resolved import Verifier

WARMUP_SAMPLES = 4


def _plan(args):
    """(timed batches, warm-up batch): the first --max-samples samples, then a few others to warm up on."""
    data = PreparedData(args.data)
    n = min(args.max_samples or len(data), len(data) - WARMUP_SAMPLES)
    if n < 1:
        sys.exit(f"error: {args.data} has {len(data)} samples; the bench needs more than {WARMUP_SAMPLES}")
    batches = [[(i, data.sample(i)[0]) for i in b if i < n] for b in plan_batches(data, args.batch_tokens, 64)]
    warmup = [(i, data.sample(i)[0]) for i in range(n, n + WARMUP_SAMPLES)]
    return data, [b for b in batches if b], warmup


def _transformers(args, data, batches, warmup) -> dict[str, list[float]]:
    from dspark.extract.transformers_engine import TransformersEngine, decoder_stack

    verifier = Verifier.resolve(args.model)
    engine = TransformersEngine(verifier, args.target_layer_ids, device="cpu")
    bare = TransformersEngine(verifier, args.target_layer_ids, device="cpu")
    for h in [m for m in bare.model.modules()]:
        h._forward_hooks.clear()  # the bare arm captures nothing
    manifest = manifest_for_model(verifier, args.target_layer_ids, data.fingerprint, encoding="raw")

    @torch.inference_mode()
    def run_bare(batches=batches):
        for b in batches:
            ids = [t for _, t in b]
            T = max(map(len, ids))
            x = torch.zeros(len(ids), T, dtype=torch.long)
            attn = torch.zeros(len(ids), T, dtype=torch.long)
            for i, t in enumerate(ids):
                x[i, : len(t)], attn[i, : len(t)] = torch.as_tensor(t), 1
            decoder_stack(bare.model)(input_ids=x, attention_mask=attn, use_cache=False)

    def run_extract(batches=batches):
        root = Path(tempfile.mkdtemp())
        try:
            sink = ZarrSink(root / "store", manifest)
            for b in batches:
                engine.run(b, sink)
            sink.close()
        finally:
            shutil.rmtree(root)

    def seconds(run):
        t = time.perf_counter()
        run()
        return time.perf_counter() - t

    run_bare([warmup]), run_extract([warmup])
    return _interleaved(args.repeats, {"bare": lambda: seconds(run_bare), "extract": lambda: seconds(run_extract)})


def _interleaved(repeats: int, arms: dict) -> dict[str, list[float]]:
    """Seconds of each arm per repeat; `arms` maps a name to a call that runs it once and returns its
    seconds. The arms' order alternates, so drift does not favour one."""
    times = {name: [] for name in arms}
    for r in range(repeats):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[name].append(arms[name]())
    return times


def _vllm_worker(args, data, batches, warmup) -> float:
    """One arm in this process: build the engine, warm it up, return the seconds of the timed batches."""
    from dspark.connector.config import SinkConfig, ZarrConfig
    from dspark.extract.base import open_engine
    from dspark.extract.config import ExtractConfig
    from dspark.vllm_server import cpu_env

    root = Path(tempfile.mkdtemp())
    try:
        if args.worker == "bare":
            import os

            os.environ.update(cpu_env())
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import LLM, SamplingParams

            llm = LLM(model=args.model, enforce_eager=not torch.cuda.is_available(), disable_log_stats=True)
            params = SamplingParams(max_tokens=1)

            def run(batch):
                llm.generate([{"prompt_token_ids": t.tolist()} for _, t in batch], params, use_tqdm=False)
        else:
            sinks = SinkConfig(to="zarr", zarr=ZarrConfig(store=str(root / "store")),
                               prepared_fingerprint=data.fingerprint)
            cfg = ExtractConfig(model=args.model, data=args.data, target_layer_ids=args.target_layer_ids,
                                engine="vllm", sink=sinks)
            verifier = Verifier.resolve(args.model)
            engine = open_engine(cfg, verifier, sinks)
            manifest = manifest_for_model(verifier, args.target_layer_ids, data.fingerprint, encoding="raw",
                                          dtype=engine.dtype_name)
            sink = ZarrSink(root / "store", manifest)

            def run(batch):
                engine.run(batch, sink)  # returns once every sample of the batch is durable
        run(warmup)
        t = time.perf_counter()
        for b in batches:
            run(b)
        return time.perf_counter() - t
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _vllm(args) -> dict[str, list[float]]:
    def worker(arm):  # its own seconds: the process's startup and warm-up are not timed
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", arm]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"error: the {arm} arm failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]

    return _interleaved(args.repeats, {arm: (lambda arm=arm: worker(arm)) for arm in ("bare", "extract")})


def paired_overheads(times: dict[str, list[float]]) -> list[float]:
    """Extract over bare per repeat: the two ran back to back, so the machine's drift mostly cancels."""
    return [x / y - 1 for x, y in zip(times["extract"], times["bare"])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--model", default="cache/models/tiny")
    ap.add_argument("--data", default="cache/prepared/demo")
    ap.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-samples", type=int, default=None, help="Time the first N samples (default: all).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    ap.add_argument("--worker", choices=["bare", "extract"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    data, batches, warmup = _plan(args)
    if args.worker:
        print(json.dumps({"seconds": _vllm_worker(args, data, batches, warmup)}))
        return
    times = _vllm(args) if args.engine == "vllm" else _transformers(args, data, batches, warmup)
    tokens = sum(len(t) for b in batches for _, t in b)
    b, e = statistics.median(times["bare"]), statistics.median(times["extract"])
    result = {"engine": args.engine, "model": args.model, "samples": sum(map(len, batches)), "tokens": tokens,
              "repeats": args.repeats, "bare_s": b, "extract_s": e, "bare_tokens_per_s": tokens / b,
              "extract_tokens_per_s": tokens / e, "overhead": e / b - 1, "times": times}
    print(f"# {args.engine}: {result['samples']} samples, {tokens} tokens, {len(batches)} batches; "
          f"{args.repeats} repeats")
    print("| arm | min s | median s | max s | tokens/s (median) |\n|---|---:|---:|---:|---:|")
    for arm, label in (("bare", "bare forward"), ("extract", "extract (capture + Zarr write)")):
        t = times[arm]
        m = statistics.median(t)
        print(f"| {label} | {min(t):.3f} | {m:.3f} | {max(t):.3f} | {tokens / m:,.0f} |")
    print(f"capture + write overhead: {100 * (e / b - 1):+.1f}% (medians); per repeat, back to back: "
          + ", ".join(f"{p:+.1%}" for p in paired_overheads(times)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, dump_json(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
