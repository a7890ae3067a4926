"""`dspark bench`: a running vLLM server measured as its users see it, acceptance read from its own counters.

Per prompt set (the formats `dspark eval --decode` reads, rendered by the same code, so the
token ids sent are the ones our decode loop is given): read /metrics, send the set's prompts
`concurrency` at a time (streamed, bounded by --max-prompts and --max-seconds), read /metrics
again. The counters' difference is what the server's drafter did on these prompts; the client's
clocks give output tokens/s, time to first token and the gaps between streamed chunks. With
--compare-endpoint the same prompts go, set by set, to a second server (e.g. one without
speculative decoding, or with n-gram), and each row gets the speedup over it.

vLLM's counters are server-wide: other traffic at the same time is counted too.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dspark.serving.bench.client import BenchError, Result, Server
from dspark.core.settings import check_settings, setting
from dspark.core.errors import InputError

WARMUP_TOKENS = 8  # one short request per server first: its one-time costs stay out of the figures
REPORT_FILES = ("bench.json", "bench.md", "bench.png")  # what write_report puts in --output


@dataclass
class BenchConfig:
    endpoint: str = setting(help="The vLLM server to measure, e.g. http://127.0.0.1:8000 (with or without /v1).")
    prompts: list[str] = setting(
        help="Prompt set (repeatable), [NAME=]PATH: chat JSONL, HumanEval, MT-bench question.jsonl, LongBench JSONL "
             "or a prepared folder, as `dspark eval --decode --prompts` reads them.")
    compare_endpoint: str | None = setting(
        None, "A second server for the same prompts (e.g. the verifier without speculative decoding): each row "
              "gets the speedup over it.")
    model: str | None = setting(None, "Served model name (default: the first the server lists).")
    tokenizer: str | None = setting(
        None, "Verifier folder or cached hub id whose chat template renders the prompts (default: the served "
              "model, when it is a local folder or cached).")
    api: Literal["completions", "chat"] = setting(
        "completions", "completions: the prompts as token ids, exactly what `dspark eval --decode` decodes; chat: "
                       "the messages, rendered by the server's own chat template.")
    concurrency: int = setting(1, "Requests in flight at once.", ge=1)
    max_prompts: int = setting(20, "Prompts per set (the first N usable ones).", ge=1)
    max_tokens: int = setting(128, "Tokens generated per request.", ge=1)
    temperature: float = setting(0.0, "0: greedy.", ge=0)
    ignore_eos: bool = setting(False, "Generate --max-tokens for every prompt (vLLM's ignore_eos).", negatable=False)
    request_timeout: float = setting(300.0, "Seconds a request may wait for its next streamed chunk (and a GET of "
                                            "/v1/models or /metrics may take in all).", gt=0)
    max_seconds: float = setting(1800.0, "Per set and server: no request starts after this many seconds, and none "
                                         "takes longer.", gt=0)
    output: str = setting("cache/bench", "Folder for bench.json, bench.md and bench.png.")

    def __post_init__(self):
        self.prompts = list(self.prompts)
        check_settings(self)
        if not self.prompts:
            raise InputError("no --prompts set given", "pass --prompts [NAME=]PATH (repeatable)")


@dataclass
class Target:
    label: str
    server: Server
    model: str
    max_model_len: int | None
    speculative: bool
    runtime: dict  # its vLLM version and model runner, as it reports them


def _target(label: str, url: str, cfg: BenchConfig, flag: str) -> Target:
    server = Server.at(url, cfg.request_timeout, cfg.max_seconds, flag)
    models = server.models()
    if cfg.model and cfg.model not in [m["id"] for m in models]:
        raise BenchError(f"{server.base} does not serve {cfg.model!r} (it serves {', '.join(m['id'] for m in models)})",
                         "pass --model with one of those names, or drop it")
    card = next(m for m in models if m["id"] == cfg.model) if cfg.model else models[0]
    reading = server.metrics()
    limit = card.get("max_model_len")
    known = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    return Target(label, server, card["id"], limit if known else None, reading.spec is not None, server.runtime())


def _payload(cfg: BenchConfig, model: str, prompt, tokens: int) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": tokens, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos}
    if cfg.api == "chat":
        return "/v1/chat/completions", {**common, "messages": list(prompt.messages)}
    return "/v1/completions", {**common, "prompt": list(prompt.ids)}


def _percentiles(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values) * 1000, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def _send_set(cfg: BenchConfig, t: Target, set_name: str, prompts: list) -> dict:
    """Every prompt of one set to one server, `concurrency` at a time; the counters' difference around it."""
    before = t.server.metrics().spec
    deadline = time.monotonic() + cfg.max_seconds
    lock, queue, results, failed = threading.Lock(), list(range(len(prompts))), [None] * len(prompts), []

    def worker():
        while True:
            with lock:
                if not queue or failed or time.monotonic() > deadline:
                    return
                i = queue.pop(0)
            route, payload = _payload(cfg, t.model, prompts[i], cfg.max_tokens)
            r = t.server.stream(route, payload)
            with lock:
                results[i] = r
                if not r.ok:
                    failed.append((i, r))

    start = time.perf_counter()
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        workers = [pool.submit(worker) for _ in range(cfg.concurrency)]
    for w in workers:
        w.result()  # a worker's unexpected exception is raised here, never lost with the prompts it left unsent
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None and r.ok]
    if failed:
        i, r = failed[0]
        raise BenchError(f"{t.server.base}: request {i + 1} of set {set_name} failed ({r.error}) after "
                         f"{len(done)} of {len(prompts)} completed", "check the server (its log) and rerun")
    after = t.server.metrics().spec
    tokens = sum(r.tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in done if r.ttft is not None and r.tokens > 1]
    out = {"server": t.label, "url": t.server.base, "requests": len(done), "not_sent": len(prompts) - len(done),
           "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall if wall else 0.0,
           "ttft_ms": _percentiles([r.ttft for r in done if r.ttft is not None]),
           "itl_ms": _percentiles([g for r in done for g in r.gaps]), "tpot_ms": _percentiles(tpot),
           "spec": None}
    if after is not None:
        try:
            out["spec"] = (after - (before or type(after)())).summary()
        except ValueError as e:
            raise BenchError(f"{t.server.base}/metrics: {e} during set {set_name}: the server restarted mid-bench",
                             "rerun the bench once the server stays up") from None
    return out


def _warm(cfg: BenchConfig, t: Target, prompt) -> None:
    route, payload = _payload(cfg, t.model, prompt, WARMUP_TOKENS)
    r: Result = t.server.stream(route, payload)
    if not r.ok:
        raise BenchError(f"{t.server.base}: a first short request failed ({r.error})",
                         "check the server (its log), --model and --api, then rerun")


def _output_folder(output: str) -> Path:
    """--output, checked by the output rule before any request, so a bench never runs to its end to find it cannot
    write: a folder, whose other files are left alone; bench's own files in it are replaced."""
    from dspark.core.outputs import check_output

    out = Path(output)
    check_output("--output", out, folder=True)
    for name in REPORT_FILES if out.is_dir() else ():  # a new folder is made only once there is a result
        check_output("--output", out / name, folder=False)
    return out


def run_bench(cfg: BenchConfig, progress: bool = True, warn=print) -> tuple[dict, Path]:
    from tqdm import tqdm

    from dspark.serving.bench.report import markdown, plot
    from dspark.data.prompts import load_prompt_set
    from dspark.core.report import write_report
    from dspark.verifier.hub import local_model
    from dspark.data.prepare import load_tokenizer

    out = _output_folder(cfg.output)
    targets = [_target("endpoint", cfg.endpoint, cfg, "--endpoint")]
    if cfg.compare_endpoint:
        targets.append(_target("compare", cfg.compare_endpoint, cfg, "--compare-endpoint"))
    main = targets[0]
    if not main.speculative:
        warn(f"{main.server.base} runs without speculative decoding (its /metrics has no vllm:spec_decode_ "
             "counters): no acceptance to report, only throughput and latency")
    try:
        tokenizer_path = local_model(cfg.tokenizer or main.model)
    except InputError as e:
        raise InputError(f"no tokenizer to render the prompts: {e.what}",
                         "pass --tokenizer VERIFIER_FOLDER (the served model's)") from None
    tokenizer = load_tokenizer(str(tokenizer_path))
    limits = [t.max_model_len for t in targets if t.max_model_len]
    limit = min(limits) if limits else None
    if limit is not None and cfg.max_tokens >= limit:  # else load_prompt_set names eval's --max-new-tokens
        raise InputError(f"--max-tokens {cfg.max_tokens} leaves no room for a prompt in the server's max_model_len "
                         f"({limit})", f"pass --max-tokens below {limit}")
    sets = [load_prompt_set(spec, tokenizer, cfg.max_prompts, limit, cfg.max_tokens) for spec in cfg.prompts]
    if cfg.api == "chat":
        bare = [s.name for s in sets if any(p.messages is None for p in s.prompts)]
        if bare:
            raise InputError(f"prompt set {bare[0]} is a prepared folder: it holds token ids, not chat messages",
                             "use --api completions for it (token ids), or pass the chat file it was prepared from")
    # A LongBench set may hold no prompt (all longer than the server takes): warm up with the first there is.
    first = next((s.prompts[0] for s in sets if s.prompts), None)
    if first is None:
        raise InputError(f"every prompt is longer than the server's max_model_len ({limit}) minus --max-tokens "
                         f"{cfg.max_tokens}", "lower --max-tokens, or serve the model with a longer --max-model-len")
    for t in targets:
        _warm(cfg, t, first)
    datasets = []
    for s in tqdm(sets, desc="bench", unit="set", disable=not progress):
        runs = [_send_set(cfg, t, s.name, s.prompts) for t in targets]
        for r in runs[1:]:
            r["speedup_of_endpoint"] = runs[0]["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else None
        entry = {**s.summary(), "runs": runs}
        if len(runs) > 1:
            entry["speedup"] = runs[1]["speedup_of_endpoint"]
        datasets.append(entry)
    result = {"endpoint": main.server.base, "compare_endpoint": targets[1].server.base if len(targets) > 1 else None,
              "model": main.model, "tokenizer": str(tokenizer_path),
              "servers": [{"label": t.label, "url": t.server.base, "model": t.model, "speculative": t.speculative,
                           "max_model_len": t.max_model_len, **t.runtime} for t in targets],
              "config": {**asdict(cfg), "endpoint": targets[0].server.base,  # as shown: no password
                         "compare_endpoint": targets[1].server.base if len(targets) > 1 else None},
              "datasets": datasets}
    write_report(result, out, "bench", markdown, plot, f"dspark bench: {main.server.base}")
    return result, out
