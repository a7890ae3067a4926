"""The Zarr store beside speculators' safetensors-file-per-sample layout: size, write, random read.

    python scripts/bench_store.py --compare safetensors                       # 4096 hidden, 6 layers, 1024-token samples
    python scripts/bench_store.py --compare safetensors --synthetic 7168 1024 16 --layers 6 --fp8
    python scripts/bench_store.py --compare safetensors --source cache/stores/demo   # real states
    python scripts/bench_store.py --compare safetensors --before /tmp/dspark-old     # also another dspark tree

Every layout stores the same samples (bf16 Gaussians with outlier channels, or
the samples of --source). Each measurement runs in a fresh process, the layouts
interleaved repetition by repetition, and the table gives medians:
- safetensors: speculators' own read (`load_file`, which maps the file), and the
  same files read into memory (loaders on filesystems without mmap); ratios in
  brackets are against the first;
- size: safetensors bytes on disk / the layout's bytes on disk;
- write: raw GB/s from the first sample to the store closed and synced to disk
  (an extraction writes far more than the page cache can hold);
- read: raw GB/s of random whole-sample reads into tensors the trainer can use,
  each copied into a batch buffer as collate does (Zarr checksums verified, as
  training reads), by 1 and by 2 reader threads; "cold"
  drops the page cache first (root only; otherwise not measured).
`--before PATH` adds the Zarr layouts as the dspark in PATH (a checkout) writes
and reads them, for before/after figures from one run. Reports; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_pass(read, ids, workers: int) -> float:
    import torch

    local = threading.local()

    def use(i):
        # Copy into a batch buffer, as collate does: safetensors maps the file, and a mapped page costs
        # its read only when used; this makes every layout pay for every byte.
        t = read(i)
        if getattr(local, "buf", None) is None or local.buf.shape != t.shape:
            local.buf = torch.empty_like(t)
        local.buf.copy_(t)

    t = time.perf_counter()
    if workers == 1:
        for i in ids:
            use(i)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(use, ids):
                pass
    return time.perf_counter() - t


def run_layout(layout: str, samples_file: Path, scratch: Path, workers: list[int], chunk_tokens: int | None) -> dict:
    """One repetition of one layout, in this (fresh) process: write, then random reads warm and cold."""
    import torch

    data = np.load(samples_file)
    bits, tokens = data["hidden"], data["tokens"]  # [N, T, L, H] uint16, [N, T]
    N, T, L, H = bits.shape
    samples = [torch.from_numpy(bits[i]).view(torch.bfloat16) for i in range(N)]
    ids = np.random.default_rng(0).permutation(N).tolist()
    raw = bits.nbytes
    if layout.startswith("safetensors"):
        from safetensors.torch import load, load_file, save_file

        def write():
            for i, h in enumerate(samples):
                save_file({"hidden_states": h, "input_ids": torch.from_numpy(tokens[i])}, scratch / f"{i}.safetensors")

        def read(i):
            path = scratch / f"{i}.safetensors"
            if layout == "safetensors":  # speculators (hs_connectors' FileTransfer): load_file, a mapped file
                return load_file(path)["hidden_states"]
            return load(path.read_bytes())["hidden_states"]  # read into memory, as loaders without mmap do
    else:
        from dspark.connector.base import Sample
        from dspark.connector.manifest import StoreManifest, default_chunk_tokens
        from dspark.connector.zarr_store import ZarrSink, ZarrStore

        encoding = "fp8_e4m3" if layout.startswith("fp8") else "raw"
        per_token = L * H * (1 if encoding == "fp8_e4m3" else 2)
        manifest = StoreManifest(verifier_name="bench", verifier_config_hash="-", tokenizer_hash="-",
                                 target_layer_ids=list(range(1, L)), num_hidden_layers=L, hidden_size=H,
                                 dtype="bfloat16", encoding=encoding, prepared_fingerprint="-",
                                 chunk_tokens=chunk_tokens or default_chunk_tokens(per_token))

        def write():
            sink = ZarrSink(scratch, manifest)
            for i, h in enumerate(samples):
                sink.write(Sample(i, tokens[i].astype(np.int64), h))
            sink.close()

        store = None

        def read(i):
            return store.read(i).hidden_states
    os.sync()
    t = time.perf_counter()
    write()
    os.sync()  # on disk: an extraction writes far more than the page cache holds
    out = {"write": raw / (time.perf_counter() - t), "disk": disk_bytes(scratch)}
    if not layout.startswith("safetensors"):
        store = ZarrStore(scratch)
    for w in workers:
        read_pass(read, ids, w)  # warm the page cache
        out[f"warm{w}"] = raw / read_pass(read, ids, w)
        if drop_page_cache():
            out[f"cold{w}"] = raw / read_pass(read, ids, w)
    return out


def make_samples(args, path: Path) -> tuple[int, list[str]]:
    rng = np.random.default_rng(0)
    if args.source:
        sys.path.insert(0, str(ROOT))
        from dspark.connector.zarr_store import ZarrStore

        got = list(ZarrStore(args.source).iter_samples())
        T = min(len(s.token_ids) for s in got)
        hidden = np.stack([s.hidden_states[:T].contiguous().view(__import__("torch").uint16).numpy() for s in got])
        tokens = np.stack([s.token_ids[:T] for s in got])
    else:
        H, T, N = args.synthetic
        import torch

        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, T, args.layers, H, generator=g)
        outliers = torch.from_numpy(rng.choice(H, size=max(1, H // 512), replace=False))
        x[..., outliers] *= 50  # a few outlier channels, as real residual streams have
        hidden = x.to(torch.bfloat16).view(torch.uint16).numpy()
        tokens = rng.integers(0, 150_000, size=(N, T))
    np.savez(path, hidden=hidden, tokens=tokens.astype(np.int64))
    N, T, L, H = hidden.shape
    return hidden.nbytes, [f"{N} samples x {T} tokens x {L} layers x {H} hidden, bf16"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=["safetensors"], default="safetensors")
    ap.add_argument("--synthetic", type=int, nargs=3, metavar=("H", "T", "N"), default=[4096, 1024, 24])
    ap.add_argument("--layers", type=int, default=6, help="captured layers (targets + the last)")
    ap.add_argument("--source", help="a dspark store whose samples to use instead of synthetic ones")
    ap.add_argument("--fp8", action="store_true", help="add the fp8_e4m3 store")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="default: the store's (~1 MiB chunks)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", type=Path, help="a dspark checkout whose Zarr store to measure too")
    ap.add_argument("--scratch", type=Path, default=None, help="folder for the stores (default: a temp folder)")
    ap.add_argument("--layout-run", nargs=3, help=argparse.SUPPRESS)  # internal: LAYOUT SAMPLES SCRATCH
    args = ap.parse_args()
    if args.layout_run:
        layout, samples, scratch = args.layout_run
        print(json.dumps(run_layout(layout, Path(samples), Path(scratch), args.workers, args.chunk_tokens)))
        return

    base = Path(tempfile.mkdtemp(dir=args.scratch))
    try:
        samples = base / "samples.npz"
        raw, desc = make_samples(args, samples)
        layouts = [("safetensors", "safetensors", ROOT), ("safetensors (read, no mmap)", "safetensors-read", ROOT)]
        kinds = ["zarr", *(["fp8"] if args.fp8 else [])]
        if args.before:
            layouts += [(f"{k} (before)", k, args.before.resolve()) for k in kinds]
        layouts += [(k, k, ROOT) for k in kinds]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in layouts}
        for rep in range(args.repeats):
            for name, kind, tree in layouts:
                scratch = base / "store"
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir()
                cmd = [sys.executable, str(Path(__file__).resolve()), "--layout-run", kind, str(samples), str(scratch),
                       "--workers", *map(str, args.workers)]
                if args.chunk_tokens:
                    cmd += ["--chunk-tokens", str(args.chunk_tokens)]
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
                results[name].append(json.loads(out.strip().splitlines()[-1]))
                print(f"rep {rep + 1}/{args.repeats} {name}: done", file=sys.stderr)
        report(results, raw, desc, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(results: dict[str, list[dict]], raw: int, desc: list[str], args) -> None:
    def med(rows, key):
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else None

    cols = ["write"] + [f"{kind}{w}" for w in args.workers for kind in ("cold", "warm")]
    ref = {k: med(results["safetensors"], k) for k in cols + ["disk"]}
    print(f"# {'; '.join(desc)}; {raw / 1e9:.2f} GB raw; medians of {args.repeats} interleaved repetitions")
    heads = ["write GB/s"] + [f"read {kind} {w}w GB/s" for w in args.workers for kind in ("cold", "warm")]
    print("| layout | size ratio | " + " | ".join(heads) + " |")
    print("|---|---:|" + "---:|" * len(heads))
    for name, rows in results.items():
        cells = [f"{ref['disk'] / med(rows, 'disk'):.2f}"]
        for k in cols:
            v = med(rows, k)
            cells.append("n/a (not root)" if v is None else
                         f"{v / 1e9:.2f}" + ("" if name == "safetensors" else f" ({v / ref[k]:.2f}x)"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, rows in results.items():
        if not name.startswith("safetensors") and len(args.workers) > 1 and 1 in args.workers:
            w = max(args.workers)
            print(f"{name}: {w} readers / 1 reader = {med(rows, f'warm{w}') / med(rows, 'warm1'):.2f}x warm"
                  + (f", {med(rows, f'cold{w}') / med(rows, 'cold1'):.2f}x cold" if med(rows, 'cold1') else ""))


if __name__ == "__main__":
    main()
