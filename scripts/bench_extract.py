"""What capturing and storing hidden states costs over a bare verifier forward.

    python scripts/bench_extract.py --model cache/models/tiny --data cache/prepared/demo [--repeats 5]

Same batches (as `dspark extract` plans them), one process, arms interleaved:
- bare: the verifier's decoder stack over each batch, nothing captured or kept;
- extract: the transformers engine (layer hooks, per-sample states) writing every
  sample to a fresh Zarr store, closed at the end (everything durable).
Prints medians and the overhead of extract over bare. Reports; asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dspark.connector.manifest import manifest_for_model
from dspark.connector.zarr_store import ZarrSink
from dspark.extract.runner import plan_batches
from dspark.extract.transformers_engine import TransformersEngine, _decoder
from dspark.prepare import PreparedData


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cache/models/tiny")
    ap.add_argument("--data", default="cache/prepared/demo")
    ap.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    data = PreparedData(args.data)
    batches = [[(i, data.sample(i)[0]) for i in b] for b in plan_batches(data, args.batch_tokens, 64)]
    tokens = sum(len(t) for b in batches for _, t in b)
    engine = TransformersEngine(args.model, args.target_layer_ids)
    bare = TransformersEngine(args.model, args.target_layer_ids)
    for h in [m for m in bare.model.modules()]:
        h._forward_hooks.clear()  # the bare arm captures nothing
    manifest = manifest_for_model(args.model, args.target_layer_ids, data.fingerprint)

    @torch.inference_mode()
    def run_bare():
        for b in batches:
            ids = [t for _, t in b]
            T = max(map(len, ids))
            x = torch.zeros(len(ids), T, dtype=torch.long)
            attn = torch.zeros(len(ids), T, dtype=torch.long)
            for i, t in enumerate(ids):
                x[i, : len(t)], attn[i, : len(t)] = torch.as_tensor(t), 1
            _decoder(bare.model)(input_ids=x, attention_mask=attn, use_cache=False)

    def run_extract():
        root = Path(tempfile.mkdtemp())
        try:
            sink = ZarrSink(root / "store", manifest)
            for b in batches:
                engine.run(b, sink)
            sink.close()
        finally:
            shutil.rmtree(root)

    times = {"bare": [], "extract": []}
    run_bare(), run_extract()  # warm up
    for _ in range(args.repeats):
        for name, f in (("bare", run_bare), ("extract", run_extract)):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    b, e = statistics.median(times["bare"]), statistics.median(times["extract"])
    print(f"# {len(data)} samples, {tokens} tokens, {len(batches)} batches; medians of {args.repeats}")
    print("| arm | seconds | tokens/s |\n|---|---:|---:|")
    print(f"| bare forward | {b:.3f} | {tokens / b:,.0f} |\n| extract (capture + Zarr write) | {e:.3f} | {tokens / e:,.0f} |")
    print(f"capture + write overhead: {100 * (e / b - 1):+.1f}%")


if __name__ == "__main__":
    main()
