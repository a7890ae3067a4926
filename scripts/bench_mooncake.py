"""Put+get throughput of dspark's Mooncake connector vs hs_connectors' MooncakeHiddenStatesStore.

    python scripts/bench_mooncake.py --source cache/stores/demo [--master HOST:PORT] [--rounds 3]

Same samples (read from a dspark Zarr store), same master, one process, each
connector with its own client; every sample is put, read back and deleted.
Starts a loopback mooncake_master when --master is not given. Reports figures;
asserts nothing.
"""

import argparse
import statistics
import subprocess
import time

import numpy as np
import torch

from dspark.connector.base import Sample

from dspark.connector.mooncake import MooncakeConfig, MooncakeReader, MooncakeSink, master_binary
from dspark.connector.zarr_store import ZarrStore
from dspark.net import free_port


def bench_dspark(samples, manifest, master):
    cfg = MooncakeConfig(master=master, global_segment_gib=1.0, local_buffer_gib=0.5)
    sink, reader = MooncakeSink(manifest, cfg), MooncakeReader(manifest, MooncakeConfig(master=master, global_segment_gib=0))
    t0 = time.perf_counter()
    transfers = [sink.write(s) for s in samples]
    t1 = time.perf_counter()
    for s, tr in zip(samples, transfers):
        reader.get(s.sample_id, tr, timeout=10)
    t2 = time.perf_counter()
    for s in samples:
        reader.delete(s.sample_id)
    return t1 - t0, t2 - t1


def bench_hs(samples, manifest, master):
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig, VERSION, packed_layout

    store = MooncakeHiddenStatesStore(MooncakeStoreConfig(master_server_address=master, global_segment_size=1 << 30,
                                                          local_buffer_size=1 << 29)).setup()
    manifests = []
    t0 = time.perf_counter()
    for s in samples:
        tok = torch.from_numpy(s.token_ids)
        spec, total = packed_layout({"hidden_states": (tuple(s.hidden_states.shape), s.hidden_states.dtype),
                                     "token_ids": (tuple(tok.shape), tok.dtype)})
        m = {"handle": f"hs/{s.sample_id}", "version": VERSION, "tensors": spec,
             "metadata": {"num_tokens": len(tok), "total_aligned_bytes": total}}
        store.put_sample(m, {"hidden_states": s.hidden_states, "token_ids": tok})
        manifests.append(m)
    t1 = time.perf_counter()
    for m in manifests:
        store.get_sample(m, timeout=10)
    t2 = time.perf_counter()
    for m in manifests:
        store.delete_sample(m["handle"])
    return t1 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--master", default=None)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--join", type=int, default=1,
                    help="Concatenate this many stored samples into one, to measure larger objects.")
    args = ap.parse_args()
    proc = None
    if args.master is None:
        port = free_port()
        proc = subprocess.Popen([master_binary(), "--rpc_port", str(port), "--metrics_port", str(free_port()),
                                 "--rpc_thread_num", "8", "--enable_disk_eviction=false"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        args.master = f"127.0.0.1:{port}"
    try:
        z = ZarrStore(args.source)
        stored = list(z.iter_samples(z.sample_ids[: args.samples * args.join]))
        samples = [Sample(i, np.concatenate([s.token_ids for s in group]),
                          torch.cat([s.hidden_states for s in group]))
                   for i, group in enumerate(stored[k : k + args.join] for k in range(0, len(stored), args.join))]
        nbytes = sum(s.hidden_states.nbytes + s.token_ids.nbytes for s in samples)
        print(f"{len(samples)} samples of {nbytes / len(samples) / 1e6:.2f} MB on average, {nbytes / 1e6:.1f} MB, "
              f"master {args.master}")
        print("| connector | put GB/s | get GB/s | put+get GB/s |")
        print("|---|---:|---:|---:|")
        for name, fn in (("dspark MooncakeSink/Reader", bench_dspark), ("hs_connectors MooncakeHiddenStatesStore", bench_hs)):
            runs = [fn(samples, z.manifest, args.master) for _ in range(args.rounds)]
            put = statistics.median(r[0] for r in runs)
            get = statistics.median(r[1] for r in runs)
            print(f"| {name} | {nbytes / put / 1e9:.3f} | {nbytes / get / 1e9:.3f} | {2 * nbytes / (put + get) / 1e9:.3f} |")
    finally:
        if proc:
            proc.kill()


if __name__ == "__main__":
    main()
