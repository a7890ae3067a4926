"""The Zarr store beside speculators' safetensors-file-per-sample layout: size, write, random read.

    python scripts/bench_store.py --compare safetensors                       # 4096 hidden, 6 layers, 1024-token samples
    python scripts/bench_store.py --compare safetensors --synthetic 7168 1024 16 --layers 6 --fp8
    python scripts/bench_store.py --compare safetensors --source cache/stores/demo   # real states
    python scripts/bench_store.py --compare safetensors --before /tmp/dspark-old     # also another dspark tree
    python scripts/bench_store.py --codecs                                     # codec table: ratio vs decode speed

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
  drops the page cache first (root only; otherwise not measured);
- GIL: the share of one warm reader's time it holds the GIL, sampled by py-spy
  (`pip install py-spy`; root); N readers go at most 1/share times one reader;
- processes: the same warm reads by as many processes as the most reader threads,
  started together: what the machine gives readers that share no GIL.
`--before PATH` adds the Zarr layouts as the dspark in PATH (a checkout) writes
and reads them, for before/after figures from one run. `--codec NAME` adds a
store of that `extract --codec`; `--chunk-sweep 8 16 32` a store per chunk size. `--codecs` prints, instead, each Blosc setting's
size ratio and decode speed on one core over the same samples. Reports; asserts nothing.
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

    # Torch ops on one thread per reader, as the trainer's loader runs them (`_one_torch_thread`): a
    # reader does not borrow the other cores through torch's intra-op team.
    with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        t = time.perf_counter()
        for _ in pool.map(use, ids):
            pass
        return time.perf_counter() - t


def gil_share(read, ids, seconds: int = 6) -> float | None:
    """The share of one warm reader's time it holds the GIL, by py-spy (None without it).

    py-spy samples this process from outside (`--gil` keeps only the samples of a thread that holds
    the GIL); the share is the reader thread's samples with the GIL over all of its samples, from two
    recordings of the same read loop. Needs ptrace rights (root, or a container with SYS_PTRACE).
    """
    import torch

    spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not spy:
        return None
    counts = []
    for gil in (["--gil"], []):
        out = Path(tempfile.mkdtemp()) / "spy.txt"
        proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--nonblocking", "--idle", "--threads",
                                 "--rate", "200", "--duration", str(seconds), "--format", "raw", "--output", str(out),
                                 *gil], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def loop():
            torch.set_num_threads(1)
            while proc.poll() is None:
                for i in ids:
                    read(i)

        reader = threading.Thread(target=loop, name="bench-reader")
        reader.start()
        reader.join()
        if proc.returncode != 0 or not out.exists():
            return None
        counts.append(sum(int(line.rsplit(" ", 1)[1]) for line in out.read_text().splitlines()
                          if ": bench-reader;" in line and "loop (" in line))
        shutil.rmtree(out.parent, ignore_errors=True)
    return counts[0] / counts[1] if counts[1] else None


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
        from safetensors.torch import save_file

        def write():
            for i, h in enumerate(samples):
                save_file({"hidden_states": h, "input_ids": torch.from_numpy(tokens[i])}, scratch / f"{i}.safetensors")

    else:
        from dspark.connector.base import Sample
        from dspark.connector.manifest import StoreManifest, default_chunk_tokens
        from dspark.connector.zarr.writer import ZarrSink

        encoding = "fp8_e4m3" if layout.startswith("fp8") else "raw"
        per_token = L * H * (1 if encoding == "fp8_e4m3" else 2)
        codec = {}  # a tree from before --codec existed has only its default
        if ":" in layout:
            from dspark.connector.manifest import codec_named

            codec = {"codec": codec_named(layout.split(":")[1])}
        if "@" in layout:
            chunk_tokens = int(layout.split("@")[1])
        manifest = StoreManifest(verifier_name="bench", verifier_config_hash="-", tokenizer_hash="-",
                                 target_layer_ids=list(range(1, L)), num_hidden_layers=L, hidden_size=H,
                                 dtype="bfloat16", encoding=encoding, prepared_fingerprint="-",
                                 chunk_tokens=chunk_tokens or default_chunk_tokens(per_token), **codec)

        def write():
            sink = ZarrSink(scratch, manifest)
            for i, h in enumerate(samples):
                sink.write(Sample(i, tokens[i].astype(np.int64), h))
            sink.close()
    os.sync()
    t = time.perf_counter()
    write()
    os.sync()  # on disk: an extraction writes far more than the page cache holds
    out = {"write": raw / (time.perf_counter() - t), "disk": disk_bytes(scratch)}
    read = open_reader(layout, scratch)
    for w in workers:
        read_pass(read, ids, w)  # warm the page cache
        out[f"warm{w}"] = raw / read_pass(read, ids, w)
        if w == 1 and (share := gil_share(read, ids)) is not None:
            out["gil"] = share
        if drop_page_cache():
            out[f"cold{w}"] = raw / read_pass(read, ids, w)
    if max(workers) > 1:  # the same reads in as many processes: what the machine gives without a shared GIL
        out[f"proc{max(workers)}"] = raw * max(workers) / process_pass(layout, scratch, ids, max(workers))
    return out


def open_reader(layout: str, scratch: Path):
    """The layout's read of sample `i` into a tensor."""
    if layout == "safetensors":  # speculators (hs_connectors' FileTransfer): load_file, a mapped file
        from safetensors.torch import load_file

        return lambda i: load_file(scratch / f"{i}.safetensors")["hidden_states"]
    if layout.startswith("safetensors"):  # read into memory, as loaders without mmap do
        from safetensors.torch import load

        return lambda i: load((scratch / f"{i}.safetensors").read_bytes())["hidden_states"]
    from dspark.connector.base import open_store

    store = open_store(scratch)
    return lambda i: store.read(i).hidden_states


def _process_reader(layout: str, scratch: Path, ids: list[int], start, times) -> None:
    read = open_reader(layout, scratch)
    read_pass(read, ids, 1)  # warm
    start.wait()
    times.put(read_pass(read, ids, 1))


def process_pass(layout: str, scratch: Path, ids: list[int], n: int) -> float:
    """Seconds until the last of `n` processes, started together, has read every sample once (warm)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter each: no GIL, no torch thread pool shared
    start, times = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_process_reader, args=(layout, scratch, ids, start, times)) for _ in range(n)]
    for p in procs:
        p.start()
    took = max(times.get() for _ in procs)
    for p in procs:
        p.join()
    return took


def codec_table(samples_file: Path, chunk_tokens: int | None) -> None:
    """Each Blosc setting's size ratio and decode GB/s on one core, over the samples' chunks as a store cuts them."""
    import numcodecs.blosc
    from numcodecs import Blosc

    from dspark.connector.manifest import default_chunk_tokens

    numcodecs.blosc.use_threads = False  # as the store reads: one core per reader
    bits = np.load(samples_file)["hidden"]
    N, T, L, H = bits.shape
    C = chunk_tokens or default_chunk_tokens(L * H * 2)
    chunks = [np.ascontiguousarray(bits[i, t : t + C]) for i in range(N) for t in range(0, T - C + 1, C)]
    raw = sum(c.nbytes for c in chunks)
    shuffles = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
    print(f"# {N} samples x {T} tokens x {L} layers x {H} hidden, bf16, {C}-token chunks; one core; best of 3")
    print("| codec | clevel | shuffle | size ratio | decode GB/s | encode GB/s |")
    print("|---|---:|---|---:|---:|---:|")
    for cname, clevel in (("zstd", 1), ("zstd", 3), ("zstd", 5), ("lz4", 1), ("lz4", 9), ("lz4hc", 5), ("blosclz", 5)):
        for shuffle in ("shuffle", "bitshuffle", "noshuffle"):
            codec = Blosc(cname=cname, clevel=clevel, shuffle=shuffles[shuffle], blocksize=1 << 20)
            t = time.perf_counter()
            encoded = [codec.encode(c) for c in chunks]
            enc = time.perf_counter() - t
            out, dec = np.empty_like(chunks[0]), float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for e in encoded:
                    codec.decode(e, out=out)
                dec = min(dec, time.perf_counter() - t)
            print(f"| {cname} | {clevel} | {shuffle} | {raw / sum(map(len, encoded)):.2f} | {raw / dec / 1e9:.2f} "
                  f"| {raw / enc / 1e9:.2f} |")


def make_samples(args, path: Path) -> tuple[int, list[str]]:
    rng = np.random.default_rng(0)
    if args.source:
        sys.path.insert(0, str(ROOT))
        from dspark.connector.base import open_store

        got = list(open_store(args.source).iter_samples())
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
    ap.add_argument("--codec", action="append", default=[], help="add a Zarr store of this `extract --codec`")
    ap.add_argument("--codecs", action="store_true", help="print the codec table instead")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="default: the store's (~1 MiB chunks)")
    ap.add_argument("--chunk-sweep", type=int, nargs="+", default=[],
                    help="add a lossless Zarr store per chunk size (tokens per chunk)")
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
        if args.codecs:
            sys.path.insert(0, str(ROOT))
            codec_table(samples, args.chunk_tokens)
            return
        layouts = [("safetensors", "safetensors", ROOT), ("safetensors (read, no mmap)", "safetensors-read", ROOT)]
        kinds = ["zarr", *(["fp8"] if args.fp8 else [])]
        if args.before:
            layouts += [(f"{k} (before)", k, args.before.resolve()) for k in kinds]
        layouts += [(k, k, ROOT) for k in kinds] + [(f"zarr {c}", f"zarr:{c}", ROOT) for c in args.codec]
        layouts += [(f"zarr, {c}-token chunks", f"zarr@{c}", ROOT) for c in args.chunk_sweep]
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
    w = max(args.workers)
    heads += ["GIL held, 1 reader"] + ([f"warm {w} processes GB/s"] if w > 1 else [])
    print("| layout | size ratio | " + " | ".join(heads) + " |")
    print("|---|---:|" + "---:|" * len(heads))
    for name, rows in results.items():
        gil = med(rows, "gil")
        cells = [f"{ref['disk'] / med(rows, 'disk'):.2f}"]
        for k in cols:
            v = med(rows, k)
            cells.append("n/a (not root)" if v is None else
                         f"{v / 1e9:.2f}" + ("" if name == "safetensors" else f" ({v / ref[k]:.2f}x)"))
        cells.append("-" if gil is None else f"{gil:.0%}")
        if w > 1:
            proc = med(rows, f"proc{w}")
            cells.append("-" if proc is None else f"{proc / 1e9:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, rows in results.items():
        if not name.startswith("safetensors") and len(args.workers) > 1 and 1 in args.workers:
            w, one, gil = max(args.workers), med(rows, "warm1"), med(rows, "gil")
            line = f"{name}: {w} readers / 1 reader = {med(rows, f'warm{w}') / one:.2f}x warm"
            if med(rows, f"proc{w}"):
                line += f" ({w} processes / 1 reader: {med(rows, f'proc{w}') / one:.2f}x)"
            if med(rows, "cold1"):
                line += f", {med(rows, f'cold{w}') / med(rows, 'cold1'):.2f}x cold"
            if gil is not None:  # Amdahl with the GIL as the only serial part: other limits (memory) not counted
                line += "; warm, N cores, GIL-bound at most " + ", ".join(
                    f"{n}: {one / (gil + (1 - gil) / n) / 1e9:.1f} GB/s" for n in (8, 32))
            print(line)


if __name__ == "__main__":
    main()
