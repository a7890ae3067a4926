"""The checks behind scripts/gpu_check_device.sh and scripts/gpu_check.sh, one subcommand each.

Each prints one line and exits 1 when its claim fails, so the scripts record a failed step and go
on. They run on any machine (CI runs them on CPU through the scripts' --dry-run):
  compare REF OTHER --bound B          relative L2 of two stores' hidden states (the same samples)
  train-ok RUN --log LOG               every logged metric finite; torch.compile recompiles counted
  same-weights A B --rel-tol T         two checkpoints' weights (resume equality)
  ddp-smoke                            under torchrun: NCCL (gloo on CPU) process group, DDP, all_reduce
  wait-ready URL PID LOG SECONDS       GET URL/health answers 200, or fail at once if PID died
  abort-probe URL DATA ID_FILE         a request dropped by its client mid-prefill, then a whole one
  send URL DATA ID...                  prepared samples as extraction requests
  absent-or-whole STORE REF ID_FILE --bound  an aborted sample is absent, or whole and right
  acceptance DRAFTED ALONE DECODED     vLLM's acceptance (dspark bench) beside dspark eval --decode's
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

# torch's own warning, with TORCH_LOGS=recompiles, once per recompilation.
RECOMPILE = re.compile(r"Recompiling function")


def fail(msg: str) -> None:
    print(f"FAIL: {msg}")
    sys.exit(1)


def rel_l2(ref, other) -> float:
    """||other - ref|| / ||ref|| in float64, so the comparison adds no rounding of its own."""
    ref, other = ref.double(), other.double()
    return ((other - ref).norm() / ref.norm()).item()


def compare(args) -> None:
    import torch

    from dspark.connector.base import open_store

    ref, other = open_store(args.ref), open_store(args.other)
    ids = other.sample_ids
    if not ids or not set(ids) <= set(ref.sample_ids) or (ids != ref.sample_ids and not args.subset):
        fail(f"{args.other} holds samples {ids[:8]}... ({len(ids)}), {args.ref} {ref.sample_ids[:8]}... ({len(ref)})")
    a = torch.cat([ref.read(i).hidden_states.flatten() for i in ids])
    b = torch.cat([other.read(i).hidden_states.flatten() for i in ids])
    err, worst = rel_l2(a, b), (a.double() - b.double()).abs().max().item()
    line = (f"{args.other} vs {args.ref}: relative L2 {err:.3g} (bound {args.bound:g}), max |diff| {worst:.3g} "
            f"over {len(ids)} samples")
    if not err <= args.bound:  # NaN fails too
        fail(line)
    print(line)


def train_ok(args) -> None:
    lines = (Path(args.run) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if x.strip()]
    train = [r for r in records if r["split"] == "train"]
    if not train:
        fail(f"{args.run}: no training step logged")
    bad = [(r["step"], r["split"], k) for r in records for k, v in r["metrics"].items()
           if isinstance(v, (int, float)) and not math.isfinite(v)]
    if bad:
        fail(f"{args.run}: non-finite metrics (step, split, name): {bad[:5]}")
    recompiles = len(RECOMPILE.findall(Path(args.log).read_text(errors="replace")))
    line = (f"{args.run}: {len(records)} records to step {records[-1]['step']}, all finite; last train loss "
            f"{train[-1]['metrics']['loss']:.4f}; {recompiles} recompiles (at most {args.max_recompiles})")
    if recompiles > args.max_recompiles:  # each one is a compile pause, and past the cache limit eager mode
        fail(line)
    print(line)


def same_weights(args) -> None:
    from safetensors.torch import load_file

    a, b = (load_file(Path(r) / "latest" / "model.safetensors") for r in (args.a, args.b))
    if a.keys() != b.keys():
        fail(f"the checkpoints hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    errs = {k: rel_l2(a[k], b[k]) for k in a if a[k].norm() > 0}
    name = max(errs, key=errs.get)
    identical = all(a[k].equal(b[k]) for k in a)
    line = (f"resumed vs uninterrupted: {'bitwise equal' if identical else 'not bitwise equal'}, worst relative "
            f"L2 {errs[name]:.3g} ({name}; bound {args.rel_tol:g})")
    if not errs[name] <= args.rel_tol:
        fail(line)
    print(line)


def ddp_smoke(args) -> None:
    """Under torchrun: init the process group (NCCL on CUDA), one DDP backward, one all_reduce. `dspark train`
    initializes no group when WORLD_SIZE is 1, so on a one-GPU machine this is what shows NCCL works."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).to(device))
    model(torch.randn(4, 8, device=device)).square().sum().backward()
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    world = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    if total.item() != world:
        fail(f"all_reduce of ones over {world} rank(s) gave {total.item()}")
    print(f"{'nccl' if cuda else 'gloo'}: DDP backward and all_reduce over {world} rank(s)")


def alive(pid: int) -> bool:
    """Running, and not a zombie: a child that its shell has not reaped yet still answers kill -0."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:  # someone else's process under a reused id: ours is gone
        return False
    return state not in ("Z", "X")


def tail(log: str, n: int = 40) -> str:
    try:
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def get(url: str, timeout: float = 5.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never ask a proxy about loopback
    with opener.open(url, timeout=timeout) as reply:
        return reply.read()


def wait_ready(url: str, pid: int, log: str, seconds: float, interval: float = 1.0) -> str | None:
    """None once URL/health answers 200; else why not (the server died, or `seconds` passed)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            get(f"{url}/health")
            return None
        except OSError:  # refused, reset, an HTTP error, a slow reply: not up yet
            pass
        if not alive(pid):
            return f"the server (pid {pid}) exited before {url}/health answered; its log ends:\n{tail(log)}"
        if time.monotonic() > deadline:
            return f"{url}/health did not answer within {seconds:g}s; the server's log ends:\n{tail(log)}"
        time.sleep(interval)


def wait_ready_cmd(args) -> None:
    why = wait_ready(args.url, args.pid, args.log, args.seconds)
    if why:
        fail(why)
    print(f"{args.url} ready")


def completion(url: str, data: str, sample_id: int, timeout: float) -> dict:
    """POST one prepared sample as the trainer's live source does: token ids, sample id, fingerprint."""
    from dspark.data.prepare import PreparedData

    model = json.loads(get(f"{url}/v1/models"))["data"][0]["id"]
    fingerprint = json.loads((Path(data) / "prepare.json").read_text())["fingerprint"]
    body = json.dumps({"model": model, "prompt": PreparedData(data).token_ids(sample_id).tolist(), "max_tokens": 1,
                       "kv_transfer_params": {"sample_id": sample_id, "prepared_fingerprint": fingerprint}})
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {text[:300]!r}")
        return json.loads(text)
    finally:
        conn.close()  # on a timeout this drops the connection: the server sees its client go


def abort_probe(args) -> None:
    """The longest prepared sample, abandoned after `--abort-after` seconds (mid-prefill with a small token
    budget per step), then the shortest one whole: the server must stay up and serve it."""
    from dspark.data.prepare import PreparedData

    data = PreparedData(args.data)
    lengths = {i: data.length(i) for i in range(len(data))}
    longest, shortest = max(lengths, key=lengths.get), min(lengths, key=lengths.get)
    try:
        completion(args.url, args.data, longest, timeout=args.abort_after)
        said = "finished before the client dropped it"
    except (socket.timeout, TimeoutError):
        said = f"dropped after {args.abort_after:g}s"
    time.sleep(2)  # the server notices the closed connection and aborts the request
    try:
        completion(args.url, args.data, shortest, timeout=120)
    except (OSError, RuntimeError) as e:
        fail(f"after the aborted request, sample {shortest} failed: {e}")
    Path(args.id_file).write_text(str(longest))
    print(f"sample {longest} ({lengths[longest]} tokens) {said}; sample {shortest} served after it")


def send(args) -> None:
    for i in args.ids:
        completion(args.url, args.data, i, timeout=120)
    print(f"{len(args.ids)} samples sent to {args.url}")


def absent_or_whole(args) -> None:
    from dspark.connector.base import open_store

    store, ref = open_store(args.store), open_store(args.ref)
    sid = int(Path(args.id_file).read_text())
    if sid not in store:
        print(f"the aborted sample {sid} is absent from {args.store}")
        return
    got, want = store.read(sid), ref.read(sid)  # read() verifies the sample's checksum
    if got.hidden_states.shape != want.hidden_states.shape:
        fail(f"the aborted sample {sid} is partial: {tuple(got.hidden_states.shape)} stored, "
             f"{tuple(want.hidden_states.shape)} expected")
    err = rel_l2(want.hidden_states, got.hidden_states)
    if not err <= args.bound:
        fail(f"the aborted sample {sid} is whole but wrong: relative L2 {err:.3g} (bound {args.bound:g})")
    print(f"the aborted sample {sid} is whole and right (relative L2 {err:.3g})")


def acceptance(args) -> None:
    """vLLM's own counters for `method: dspark` beside dspark's decode loop, and the speedup over the verifier alone
    (two benches of the same prompts, run one after the other)."""
    def first_set(folder: str, name: str) -> dict:
        return json.loads((Path(folder) / name).read_text())["datasets"][0]

    drafted, alone = (first_set(f, "bench.json")["runs"][0] for f in (args.drafted, args.alone))
    ours = first_set(args.decoded, "decode.json")["decoded"]
    spec = drafted["spec"]
    if not spec or not spec["drafts"]:
        fail("method dspark served no drafts")
    print("per position, vLLM / ours:", [(round(a["rate"], 3), round(b["rate"], 3))
                                         for a, b in zip(spec["positions"], ours["positions"])])
    print(f"method dspark in vLLM: mean acceptance length {spec['mean_acceptance_length']:.2f}, "
          f"{drafted['tokens_per_s'] / alone['tokens_per_s']:.2f}x the verifier alone's tokens/s; "
          f"our decode loop: {ours['mean_acceptance_length']:.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("other")
    c.add_argument("--bound", type=float, required=True)
    c.add_argument("--subset", action="store_true", help="OTHER may hold only some of REF's samples.")
    c.set_defaults(fn=compare)
    c = sub.add_parser("train-ok")
    c.add_argument("run")
    c.add_argument("--log", required=True)
    # Block masks, batch shapes and the validation pass each compile; more means shapes that vary per step.
    c.add_argument("--max-recompiles", type=int, default=8)
    c.set_defaults(fn=train_ok)
    c = sub.add_parser("same-weights")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--rel-tol", type=float, required=True)
    c.set_defaults(fn=same_weights)
    c = sub.add_parser("ddp-smoke")
    c.add_argument("--cpu", action="store_true", help="gloo on the CPU even where CUDA is.")
    c.set_defaults(fn=ddp_smoke)
    c = sub.add_parser("wait-ready")
    c.add_argument("url")
    c.add_argument("pid", type=int)
    c.add_argument("log")
    c.add_argument("seconds", type=float)
    c.set_defaults(fn=wait_ready_cmd)
    c = sub.add_parser("abort-probe")
    c.add_argument("url")
    c.add_argument("data")
    c.add_argument("--abort-after", type=float, default=0.05)
    c.add_argument("id_file", help="Where the aborted sample's id is written, for absent-or-whole.")
    c.set_defaults(fn=abort_probe)
    c = sub.add_parser("send")
    c.add_argument("url")
    c.add_argument("data")
    c.add_argument("ids", type=int, nargs="+")
    c.set_defaults(fn=send)
    c = sub.add_parser("absent-or-whole")
    c.add_argument("store")
    c.add_argument("ref")
    c.add_argument("id_file")
    c.add_argument("--bound", type=float, required=True)
    c.set_defaults(fn=absent_or_whole)
    c = sub.add_parser("acceptance")
    c.add_argument("drafted", help="dspark bench's folder against the drafted server")
    c.add_argument("alone", help="... and against the verifier alone")
    c.add_argument("decoded", help="dspark eval --decode's folder")
    c.set_defaults(fn=acceptance)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
