"""Put+get throughput of dspark's Mooncake connector vs hs_connectors' MooncakeHiddenStatesStore.

    python scripts/bench_mooncake.py --sizes-mb 0.1 2 50 [--rounds 5] [--master HOST:PORT]
    python scripts/bench_mooncake.py --source cache/stores/demo [--join 4]   # real samples

Same samples, same master, one process. Each connector gets the same topology: a
producer client and a consumer client (as an extractor and a trainer); by default a
third client mounts the memory the objects live in (--mount), so both connectors'
objects cross the same transport. Clients are kept across rounds so staging buffers are registered
once. Every sample is put, read back (and, for dspark, checksum-verified and
identity-checked) and then deleted, untimed. Rounds interleave the two arms
(alternating which goes first) after one untimed warm-up round each; the table
holds medians. With --sizes-mb the samples are synthetic bf16 hidden states
[T, layers, hidden] sized to the object size, under a fake store manifest.
--no-checksum-in-transfer makes dspark read the `<key>:manifest` object, as on the
live path where the HTTP reply is answered before the checksum exists.
Starts a loopback mooncake_master when --master is not given. Reports; asserts nothing.
"""

import argparse
import itertools
import statistics
import subprocess
import time

import numpy as np
import torch

from dspark.connector.base import Sample
from dspark.connector.manifest import StoreManifest
from dspark.connector.config import MasterConfig
from dspark.connector.config import MooncakeConfig
from dspark.connector.mooncake.client import connect, master_binary
from dspark.connector.mooncake.reader import MooncakeReader
from dspark.connector.mooncake.sink import MooncakeSink
from dspark.core.net import free_port, wait


class Dspark:
    name = "dspark"

    def __init__(self, manifest, master, mount, strip_checksum=False):
        seg = {"producer": (2.0, 0.0), "consumer": (0.0, 2.0), "holder": (0.0, 0.0)}[mount]
        self.sink = MooncakeSink(manifest, MooncakeConfig(master=master, global_segment_gib=seg[0],
                                                          local_buffer_gib=0.5))
        self.reader = MooncakeReader(manifest, MooncakeConfig(master=master, global_segment_gib=seg[1],
                                                              local_buffer_gib=0.5))
        self.strip = strip_checksum

    def round(self, samples):
        t0 = time.perf_counter()
        transfers = [self.sink.put(s) for s in samples]
        t1 = time.perf_counter()
        if self.strip:
            transfers = [{**tr, "metadata": {k: v for k, v in tr["metadata"].items() if k != "xxh3_64"}}
                         for tr in transfers]
        got = [self.reader.get(s.sample_id, tr, timeout=10) for s, tr in zip(samples, transfers)]
        t2 = time.perf_counter()
        for g in got:
            self.reader.delete(g)
        return t1 - t0, t2 - t1


class HsConnectors:
    name = "hs_connectors"

    def __init__(self, manifest, master, mount):
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

        seg = {"producer": (2 << 30, 0), "consumer": (0, 2 << 30), "holder": (0, 0)}[mount]
        self.producer, self.consumer = (MooncakeHiddenStatesStore(MooncakeStoreConfig(
            local_hostname="127.0.0.1", master_server_address=master, global_segment_size=size,
            local_buffer_size=1 << 29)).setup() for size in seg)

    def round(self, samples):
        from hs_connectors.mooncake_store import VERSION, packed_layout

        manifests = []
        t0 = time.perf_counter()
        for s in samples:
            tok = torch.from_numpy(s.token_ids)
            spec, total = packed_layout({"hidden_states": (tuple(s.hidden_states.shape), s.hidden_states.dtype),
                                         "token_ids": (tuple(tok.shape), tok.dtype)})
            m = {"handle": f"hs/{s.sample_id}", "version": VERSION, "tensors": spec,
                 "metadata": {"num_tokens": len(tok), "total_aligned_bytes": total}}
            self.producer.put_sample(m, {"hidden_states": s.hidden_states, "token_ids": tok})
            manifests.append(m)
        t1 = time.perf_counter()
        for m in manifests:
            self.consumer.get_sample(m, timeout=10)
        t2 = time.perf_counter()
        for m in manifests:
            self.consumer.delete_sample(m["handle"])
        return t1 - t0, t2 - t1


def fake_manifest(layers: int, hidden: int) -> StoreManifest:
    return StoreManifest(verifier_name="bench", verifier_config_hash="bench", tokenizer_hash="bench",
                         target_layer_ids=list(range(1, layers)), num_hidden_layers=layers, hidden_size=hidden,
                         dtype="bfloat16", chunk_tokens=256, prepared_fingerprint="bench")


def synthetic(manifest: StoreManifest, size_mb: float, budget_mb: float, max_samples: int) -> list[Sample]:
    """bf16 samples whose packed object is about `size_mb`; as many as fit `budget_mb`."""
    per_token = len(manifest.captured_layer_ids) * manifest.hidden_size * 2 + 8
    tokens = max(1, round(size_mb * 1e6 / per_token))
    n = max(4, min(max_samples, int(budget_mb / size_mb)))
    g = torch.Generator().manual_seed(int(size_mb * 1000))
    return [Sample(i, np.arange(tokens, dtype=np.int64) + i,
                   torch.randn(tokens, len(manifest.captured_layer_ids), manifest.hidden_size,
                               generator=g).to(torch.bfloat16))
            for i in range(n)]


def from_source(source: str, samples: int, join: int):
    from dspark.connector.base import open_store

    z = open_store(source)
    stored = list(z.iter_samples(z.sample_ids[: samples * join]))
    return z.manifest, [Sample(i, np.concatenate([s.token_ids for s in group]),
                               torch.cat([s.hidden_states for s in group]))
                        for i, group in enumerate(stored[k : k + join] for k in range(0, len(stored), join))]


ROUNDS = itertools.count(int(time.time()) % 100_000 * 1000)


def measure(arms, samples, rounds):
    """Interleaved rounds after an untimed warm-up; per arm the median put and get seconds.

    Every round uses fresh sample ids (fresh keys), so no put overwrites an object."""
    def fresh(r):
        base = next(ROUNDS) * 10_000
        return [Sample(base + s.sample_id, s.token_ids, s.hidden_states) for s in samples]

    for arm in arms:
        arm.round(fresh(0))
    runs = {arm.name: [] for arm in arms}
    for r in range(rounds):
        batch = fresh(r + 1)
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            runs[arm.name].append(arm.round(batch))
    return {name: (statistics.median(p for p, _ in rs), statistics.median(g for _, g in rs),
                   statistics.median(p + g for p, g in rs)) for name, rs in runs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[0.1, 2, 50],
                    help="Object sizes of synthetic samples (ignored with --source).")
    ap.add_argument("--layers", type=int, default=4, help="Captured layers of the fake store (layer axis).")
    ap.add_argument("--hidden-size", type=int, default=4096)
    ap.add_argument("--budget-mb", type=float, default=200, help="Bytes per round per size (sets the sample count).")
    ap.add_argument("--source", default=None, help="A dspark Zarr store: bench its samples instead.")
    ap.add_argument("--join", type=int, default=1, help="With --source: concatenate this many samples into one.")
    ap.add_argument("--master", default=None)
    ap.add_argument("--samples", type=int, default=200, help="At most this many samples per size.")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-checksum-in-transfer", action="store_true",
                    help="dspark reads the checksum from the <key>:manifest object (the live path).")
    ap.add_argument("--mount", choices=["holder", "producer", "consumer"], default="holder",
                    help="Which client mounts the memory the objects live in: a third client that neither "
                         "connector uses (the default: every object crosses the transport the same way for both), "
                         "or each connector's producer/consumer. With producer: dspark's producer puts into its "
                         "own segment (a local memcpy, as on an extractor node that mounts memory), hs_connectors' "
                         "objects land where the master puts them (random over both producers' segments: half "
                         "local, half over TCP, as with 2 extractor nodes).")
    args = ap.parse_args()
    proc = None
    if args.master is None:
        port = free_port("127.0.0.1")
        proc = subprocess.Popen([master_binary(), *MasterConfig(port=port, metrics_port=free_port("127.0.0.1")).argv()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args.master = f"127.0.0.1:{port}"
        if wait(f"tcp://{args.master}", timeout=30):
            raise SystemExit(f"the Mooncake master did not start on {args.master}")
    try:
        if args.source:
            manifest, samples = from_source(args.source, args.samples, args.join)
            cases = [(sum(s.hidden_states.nbytes for s in samples) / len(samples) / 1e6, samples)]
        else:
            manifest = fake_manifest(args.layers, args.hidden_size)
            cases = [(mb, None) for mb in args.sizes_mb]
        holder = connect(MooncakeConfig(master=args.master, global_segment_gib=4.0)) if args.mount == "holder" \
            else None
        arms = [Dspark(manifest, args.master, args.mount, args.no_checksum_in_transfer),
                HsConnectors(manifest, args.master, args.mount)]
        print(f"master {args.master}, memory mounted by the {args.mount}, {len(manifest.captured_layer_ids)} layers x "
              f"{manifest.hidden_size} bf16, {args.rounds} interleaved rounds (medians), GB/s of payload")
        print("| size MB | samples | ours put | ours get | ours put+get | theirs put | theirs get | theirs put+get "
              "| ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mb, samples in cases:
            samples = samples or synthetic(manifest, mb, args.budget_mb, args.samples)
            nbytes = sum(s.hidden_states.nbytes + s.token_ids.nbytes for s in samples)
            res = measure(arms, samples, args.rounds)
            (op, og, ot), (tp, tg, tt) = res["dspark"], res["hs_connectors"]
            gb = nbytes / 1e9
            print(f"| {nbytes / len(samples) / 1e6:.2f} | {len(samples)} | {gb / op:.3f} | {gb / og:.3f} "
                  f"| {2 * gb / ot:.3f} | {gb / tp:.3f} | {gb / tg:.3f} | {2 * gb / tt:.3f} | {tt / ot:.2f}x |",
                  flush=True)
        del holder
    finally:
        if proc:
            proc.kill()


if __name__ == "__main__":
    main()
