"""Can the training loader feed a fast step? Data-wait with production-shaped states.

    python scripts/bench_loader.py                     # hidden 7168, 5 targets + last, 1024-token samples
    python scripts/bench_loader.py --rates 1.0 2.0 --workers 2 --samples 32

Builds a prepared data folder and a Zarr store of Kimi-K3-shaped hidden states
(~86 KB per token), then runs the trainer's own TrainData + Loader (checksums,
packing, collate) under a fake step that consumes each batch's hidden-state
bytes at RATE GB/s (it sleeps: on a GPU the step's compute is not the host's).
Reports, per rate, warm and cold (page cache dropped; root only): the share of
the epoch the step spent waiting for data after the first batch, and the wait for
that first one. Reports; asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dspark.connector.base import Sample, Source, open_store
from dspark.connector.manifest import StoreManifest, default_chunk_tokens
from dspark.connector.zarr.writer import ZarrSink
from dspark.data.prepare import PreparedData
from dspark.train.data import Loader, TrainData

from bench_store import drop_page_cache  # a sibling script (scripts/ is on sys.path when run)


def make_prepared(root: Path, n: int, T: int) -> PreparedData:
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, 150_000, size=n * T).astype(np.int32)
    loss_mask = np.ones(n * T, dtype=np.uint8)
    offsets = np.arange(0, n * T + 1, T, dtype=np.int64)
    root.mkdir(parents=True)
    for name, arr in (("input_ids.npy", input_ids), ("loss_mask.npy", loss_mask), ("offsets.npy", offsets)):
        np.save(root / name, arr)
    torch.save({}, root / "token_freq.pt")
    fp = hashlib.sha256(input_ids.tobytes() + loss_mask.tobytes() + offsets.tobytes()).hexdigest()
    (root / "prepare.json").write_text(json.dumps({"fingerprint": fp, "tokenizer_hash": "bench"}))
    return PreparedData(root)


def make_store(root: Path, prepared: PreparedData, hidden: int, layers: int) -> Source:
    m = StoreManifest(verifier_name="bench", verifier_config_hash="-", tokenizer_hash="bench",
                      target_layer_ids=list(range(1, layers)), num_hidden_layers=layers, hidden_size=hidden,
                      dtype="bfloat16", prepared_fingerprint=prepared.fingerprint,
                      chunk_tokens=default_chunk_tokens(layers * hidden * 2))
    sink = ZarrSink(root, m)
    g = torch.Generator().manual_seed(0)
    for i in range(len(prepared)):
        ids = prepared.token_ids(i)
        x = torch.randn(len(ids), layers, hidden, generator=g)
        x[..., :: 512] *= 50  # outlier channels
        sink.write(Sample(i, ids, x.to(torch.bfloat16)))
    sink.close()
    return open_store(root)


def run(data: TrainData, rate: float, workers: int, prefetch: int) -> tuple[float, float, float, float]:
    """(data-wait share after the first batch, first batch s, seconds, GB) of one epoch at `rate` GB/s.

    The first batch waits for the readers to start whatever the loader does; a real epoch has
    thousands of batches, so the share that matters is the steady one after it.
    """
    loader = Loader(data, data.epoch_batches(0), workers, prefetch)
    consumed, first, t0 = 0, None, time.perf_counter()
    for batch in loader:
        if first is None:
            first, t1 = loader.wait_seconds, time.perf_counter()
        nbytes = batch["hidden_states"].nbytes + batch["verifier_last_hidden_states"].nbytes
        consumed += nbytes
        time.sleep(nbytes / (rate * 1e9))  # the fake step
    steady = time.perf_counter() - t1
    return (loader.wait_seconds - first) / steady, first, time.perf_counter() - t0, consumed / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=6, help="captured layers (targets + the last)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--total-seq-len", type=int, default=4096, help="tokens per batch")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0], help="GB/s the fake step consumes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--scratch", type=Path, default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.scratch))
    try:
        prepared = make_prepared(base / "prepared", args.samples, args.tokens)
        store = make_store(base / "store", prepared, args.hidden, args.layers)
        data = TrainData(store, prepared, args.total_seq_len, train_ratio=1 - 1 / args.samples, seed=0,
                         on_damaged="skip")  # one held out: the split needs both sides
        print(f"# {args.samples} samples x {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden "
              f"({args.layers * args.hidden * 2 / 1e3:.0f} KB/token), store {store.disk_bytes() / 1e9:.2f} GB on disk; "
              f"{args.workers} reader threads, {args.prefetch} batches ahead")
        print("| step consumes | page cache | data-wait (after the first batch) | first batch s | epoch s | GB |\n"
              "|---:|---|---:|---:|---:|---:|")
        for rate in args.rates:
            for cache in ("warm", "cold"):
                if cache == "warm":
                    run(data, rate, args.workers, args.prefetch)  # fill the page cache
                elif not drop_page_cache():
                    continue
                share, first, secs, gb = run(data, rate, args.workers, args.prefetch)
                print(f"| {rate:.1f} GB/s | {cache} | {100 * share:.1f}% | {first:.2f} | {secs:.2f} | {gb:.2f} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
