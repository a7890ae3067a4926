"""Measure the Zarr store on real hidden states: compression ratio, write and random-read throughput.

    python scripts/bench_store.py --source cache/stores/demo [--chunk-tokens 64 256 1024] [--fp8]
    python scripts/bench_store.py --source cache/stores/demo --synthetic 4096 2048 24 --chunk-tokens 32

Samples are read once from --source (any dspark store), then rewritten into a
scratch store per chunk size. `--synthetic H T N` replaces them with N Gaussian
samples of T tokens at hidden size H (same layer count), to see how a
production-sized model's states read and write (ratios on random data are not
those of real states). Reports figures; asserts nothing.
"""

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dspark.connector.base import Sample
from dspark.connector.zarr_store import ZarrSink, ZarrStore


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--synthetic", type=int, nargs=3, metavar=("H", "T", "N"), default=None)
    args = ap.parse_args()
    src = ZarrStore(args.source)
    manifest = src.manifest
    if args.synthetic:
        H, T, N = args.synthetic
        manifest = manifest.model_copy(update={"hidden_size": H})
        g = torch.Generator().manual_seed(0)
        L = len(manifest.captured_layer_ids)
        samples = [Sample(i, np.zeros(T, dtype=np.int64), torch.randn(T, L, H, generator=g).to(torch.bfloat16))
                   for i in range(N)]
    else:
        samples = list(src.iter_samples())
    raw = sum(s.hidden_states.numel() * s.hidden_states.element_size() for s in samples)
    print(f"{len(samples)} samples, {raw / 1e6:.1f} MB raw, "
          f"hidden_size={manifest.hidden_size} layers={manifest.captured_layer_ids}")
    print("chunk_tokens  encoding  ratio  write_GB/s  rand_read_GB/s  seq_read_GB/s")
    for ct in args.chunk_tokens:
        tmp = Path(tempfile.mkdtemp())
        try:
            m = manifest.model_copy(update={"chunk_tokens": ct,
                                                "encoding": "fp8_e4m3" if args.fp8 else "raw"})
            t = time.perf_counter()
            sink = ZarrSink(tmp, m)
            for s in samples:
                sink.write(s)
            sink.close()
            w = time.perf_counter() - t
            st = ZarrStore(tmp)
            ids = random.Random(0).sample(st.sample_ids, min(args.reads, len(st)))
            t = time.perf_counter()
            nbytes = sum(st.read(i).hidden_states.nbytes for i in ids)
            r = time.perf_counter() - t
            t = time.perf_counter()
            sbytes = sum(s.hidden_states.nbytes for s in st.iter_samples())
            sr = time.perf_counter() - t
            print(f"{ct:12d}  {m.encoding:8s}  {raw / st.disk_bytes():5.2f}  {raw / w / 1e9:10.3f}"
                  f"  {nbytes / r / 1e9:14.3f}  {sbytes / sr / 1e9:13.3f}")
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
