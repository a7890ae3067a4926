"""`dspark bench` against a fake vLLM: an OpenAI-compatible server on a free local port whose /metrics
speaks vLLM's Prometheus text and whose spec-decode counters move by a scripted amount per request,
so every figure the bench reports is known exactly. Broken servers (no spec decode, not vLLM, dying
mid-run, not there at all) must each end in one readable line.
"""

import copy
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import run_cli, write_jsonl

from dspark.bench.client import BenchError
from dspark.bench.metrics import Reading, SpecCounters, read
from dspark.bench.run import WARMUP_TOKENS, BenchConfig, run_bench
from dspark.errors import InputError

MODEL = "toy"
MAX_MODEL_LEN = 512
LABELS = f'engine="0",model_name="{MODEL}"'
# Counters at start-up: nonzero, in other ratios than a request's, so only deltas give the expected rates.
START = {"drafts": 12, "draft_tokens": 48, "per_pos": [10, 5, 3, 2]}
# What each request adds: accepted per position over drafts = [1, 2/3, 1/3, 0], mean length 1 + 6/3 = 3.
STEP = {"drafts": 3, "draft_tokens": 12, "per_pos": [3, 2, 1, 0]}
RATES = [a / STEP["drafts"] for a in STEP["per_pos"]]
MEAN_LENGTH = 1 + sum(STEP["per_pos"]) / STEP["drafts"]
CHUNKS = 3  # content chunks per streamed reply
TOPICS = ["rain", "trains", "cats", "the sea", "bread"]  # one MT-bench question each


# --- vLLM's /metrics text -------------------------------------------------------------------------------

def _family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric family as prometheus_client writes it: a counter's `_created` samples after its own."""
    full = f"{name}_total" if kind == "counter" else name
    lines = [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{{{labels}}} {value!r}" for labels, value in samples]
    if kind == "counter":
        lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        lines += [f"{name}_created{{{labels}}} 1.7e+09" for labels, _ in samples]
    return lines


def metrics_text(spec: dict | None, prompt_tokens: int = 0, labels: str = LABELS) -> str:
    """A vLLM server's /metrics: process metrics, a few vllm: ones, and the spec-decode counters if `spec`."""
    lines = ['# HELP python_gc_objects_collected_total Objects collected during gc',
             '# TYPE python_gc_objects_collected_total counter',
             'python_gc_objects_collected_total{generation="0"} 1234.0']
    lines += _family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                     [(labels, 0.0)])
    lines += _family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                     [(labels, float(prompt_tokens))])
    if spec is not None:
        lines += _family("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.",
                         [(labels, float(spec["drafts"]))])
        lines += _family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.",
                         [(labels, float(spec["draft_tokens"]))])
        lines += _family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
                         [(labels, float(sum(spec["per_pos"])))])
        lines += _family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                         "Accepted tokens per draft position.",
                         [(f'{labels},position="{k}"', float(a)) for k, a in enumerate(spec["per_pos"])])
    return "\n".join(lines) + "\n"


# --- the fake server ------------------------------------------------------------------------------------

@dataclass
class FakeVLLM:
    spec: bool = True              # False: a vLLM server without speculative decoding
    vllm: bool = True              # False: /metrics answers 404 (an OpenAI-compatible server that is not vLLM)
    die_after: int | None = None   # answer this many POSTs, then drop the next connection and go down
    stream_error: str | None = None  # every reply fails mid-stream with this message, as vLLM reports it
    runner: str | None = None      # "v1"/"v2": GET /dspark/server answers it, as serve-draft's vLLM does
    posts: list[tuple[str, dict]] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: copy.deepcopy(START))
    prompt_tokens: int = 0

    def __post_init__(self):
        self.lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.fake = self
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()  # quick to stop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def take(self, path: str, body: dict) -> bool:
        """Record a request and move the counters as the server's drafter would; False: the server is down."""
        with self.lock:
            self.posts.append((path, body))
            if self.die_after is not None and len(self.posts) > self.die_after:
                return False
            self.prompt_tokens += len(body.get("prompt") or ())
            c = self.counters
            c["drafts"] += STEP["drafts"]
            c["draft_tokens"] += STEP["draft_tokens"]
            c["per_pos"] = [a + b for a, b in zip(c["per_pos"], STEP["per_pos"])]
            return True

    def metrics(self) -> str | None:
        with self.lock:
            return metrics_text(self.counters if self.spec else None, self.prompt_tokens) if self.vllm else None

    def sent(self, path: str = "/v1/completions") -> list[dict]:
        """The bench's request bodies to `path`, the warm-up request (always the first) left out."""
        return [b for p, b in self.posts[1:] if p == path]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # so a handler may close its own server without joining itself


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection, the reply ends when it closes

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _reply(self, code: int, ctype: str, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, obj) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def do_GET(self):
        fake: FakeVLLM = self.server.fake
        if self.path == "/v1/models":
            self._reply(200, "application/json", json.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]}))
        elif self.path == "/metrics" and (text := fake.metrics()) is not None:
            self._reply(200, "text/plain; version=0.0.4; charset=utf-8", text)
        elif self.path == "/version":
            self._reply(200, "application/json", json.dumps({"version": "0.33.0"}))
        elif self.path == "/dspark/server" and fake.runner:
            self._reply(200, "application/json", json.dumps({"vllm_model_runner": fake.runner}))
        else:
            self._reply(404, "application/json", json.dumps({"detail": "Not Found"}))

    def do_POST(self):
        fake: FakeVLLM = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not fake.take(self.path, body):
            # A crash: this connection closes without a reply and the port stops listening.
            self.close_connection = True
            threading.Thread(target=fake.stop, daemon=True).start()
            return
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(CHUNKS):
            self._event({"choices": [{"delta": {"content": "ab"}, "index": 0} if chat else {"text": "ab", "index": 0}]})
            time.sleep(0.002)  # so the client sees a first token and gaps after it
            if fake.stream_error:  # vLLM's error chunk, and still [DONE] after it
                self._event({"error": {"object": "error", "message": fake.stream_error, "type": "InternalServerError",
                                       "code": 500}})
                break
        self._event({"choices": [], "usage": {"prompt_tokens": len(body.get("prompt") or ()),
                                              "completion_tokens": body["max_tokens"]}})
        self._event(b"[DONE]")


@pytest.fixture
def serve():
    """Start fake servers (keyword arguments as FakeVLLM's); all are stopped after the test."""
    started = []

    def start(**kw) -> FakeVLLM:
        started.append(FakeVLLM(**kw))
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


# --- prompt sets in their real formats ------------------------------------------------------------------

@pytest.fixture
def sets(tmp_path) -> dict:
    mtbench = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81 + i, "category": "writing", "turns": [f"Write a haiku about {topic}.", "Now another."]}
        for i, topic in enumerate(TOPICS)])
    humaneval = write_jsonl(tmp_path / "HumanEval.jsonl", [
        {"task_id": f"HumanEval/{i}", "prompt": f"def {name}(x):\n    \"\"\"Return x.\"\"\"\n", "entry_point": name,
         "canonical_solution": "    return x\n", "test": ""} for i, name in enumerate(["f", "g"])])
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
                      {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]}])
    return {"mtbench": mtbench, "humaneval": humaneval, "chat": chat}


def bench_args(endpoint: str, verifier, out, *prompts, **flags) -> list[str]:
    """`dspark bench`'s command line; no progress bar, so stderr holds only the lines a test asserts."""
    args = ["bench", "--endpoint", endpoint, "--tokenizer", verifier, "--output", out, "--no-progress"]
    for p in prompts:
        args += ["--prompts", p]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])
    return args


def bench(fake, verifier, tmp_path, prompts, warn=print, **kw) -> dict:
    """run_bench in this process, for its numbers: bench.json's content."""
    return run_bench(BenchConfig(endpoint=fake.url, prompts=[str(p) for p in prompts], tokenizer=str(verifier),
                                 output=str(tmp_path), **kw), progress=False, warn=warn)[0]


def one_line(stderr: str, prefix: str) -> str:
    """The one line stderr holds, which must start with `prefix`."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


def prompt_ids(verifier, path, **kw) -> list[tuple[int, ...]]:
    """What `dspark eval --decode` would decode for this file: the ids the completions API must be sent."""
    from dspark.decode.prompts import load_prompt_set
    from dspark.prepare import load_tokenizer

    return [p.ids for p in load_prompt_set(str(path), load_tokenizer(str(verifier)), max_length=MAX_MODEL_LEN,
                                           **kw).prompts]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- counters -------------------------------------------------------------------------------------------

def test_counters_are_summed_over_engines_and_positions_ordered_by_label():
    # Two engines (data-parallel ranks), the second's positions listed out of order, `_created` samples at
    # start-up timestamps that would swamp any sum they were counted in.
    engine0 = metrics_text({"drafts": 10, "draft_tokens": 40, "per_pos": [8, 4, 2, 1]})
    engine1 = metrics_text({"drafts": 2, "draft_tokens": 8, "per_pos": [2, 1, 0, 0]},
                           labels='engine="1",model_name="m"')
    shuffled = engine1.splitlines()
    per_pos = [line for line in shuffled if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    shuffled = [line for line in shuffled if line not in per_pos] + per_pos[::-1]
    reading = read(engine0 + "\n".join(shuffled) + "\n")
    assert reading.is_vllm
    assert reading.spec == SpecCounters(drafts=12, draft_tokens=48, accepted=18, per_position=(10, 5, 2, 1))

    later = SpecCounters(drafts=18, draft_tokens=72, accepted=30, per_position=(16, 9, 4, 1))
    summary = (later - reading.spec).summary()
    assert (summary["drafts"], summary["draft_tokens"], summary["accepted_tokens"]) == (6, 24, 12)
    assert [p["rate"] for p in summary["positions"]] == RATES
    assert [p["conditional"] for p in summary["positions"]] == [1.0, 4 / 6, 2 / 4, 0.0]
    assert summary["mean_acceptance_length"] == MEAN_LENGTH
    # A later reading with more positions (a restart with more speculative tokens) pads the earlier one.
    assert SpecCounters(3, 9, 3, (2, 1, 0)) - SpecCounters(1, 3, 1, (1,)) == SpecCounters(2, 6, 2, (1, 1, 0))


def test_metrics_without_spec_counters_or_without_vllm():
    assert read(metrics_text(None)) == Reading(is_vllm=True, spec=None)
    not_vllm = read('# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n')
    assert not not_vllm.is_vllm and not_vllm.spec is None


# --- measuring a server ---------------------------------------------------------------------------------

def test_bench_reports_the_servers_own_counters(serve, sets, verifier, tmp_path):
    fake = serve()
    out = tmp_path / "bench"
    proc = run_cli(*bench_args(fake.url + "/v1/", verifier, out, f"mt={sets['mtbench']}", sets["humaneval"],
                               concurrency=2, max_tokens=16, ignore_eos=True))
    assert proc.stderr == ""
    result = json.loads((out / "bench.json").read_text())
    assert result["endpoint"] == fake.url  # given with /v1/, as clients are often configured

    expected = {"mt": prompt_ids(verifier, sets["mtbench"], max_new_tokens=16),
                "HumanEval": prompt_ids(verifier, sets["humaneval"], max_new_tokens=16)}
    assert [d["name"] for d in result["datasets"]] == list(expected)
    for d in result["datasets"]:
        (run,) = d["runs"]
        n = len(expected[d["name"]])
        assert (run["requests"], run["not_sent"], run["tokens"]) == (n, 0, 16 * n)
        assert run["tokens_per_s"] > 0 and run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p50"] > 0
        spec = run["spec"]  # this set's requests only: not the start-up counts, not the warm-up request
        assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (3 * n, 12 * n, 6 * n)
        assert [p["accepted"] for p in spec["positions"]] == [a * n for a in STEP["per_pos"]]
        assert [p["rate"] for p in spec["positions"]] == RATES
        assert spec["mean_acceptance_length"] == MEAN_LENGTH

    # The token ids `dspark eval --decode` decodes, each prompt once, with the flags given, after one short
    # warm-up request whose counts fall outside every set's.
    warm = fake.posts[0][1]
    assert (tuple(warm["prompt"]), warm["max_tokens"]) == (expected["mt"][0], WARMUP_TOKENS)
    sent = fake.sent()
    assert sorted(tuple(b["prompt"]) for b in sent) == sorted(ids for s in expected.values() for ids in s)
    for b in sent:
        assert (b["model"], b["max_tokens"], b["ignore_eos"], b["temperature"]) == (MODEL, 16, True, 0.0)
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}

    md = (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert md in proc.stdout  # the CLI prints the table it wrote
    for name in expected:
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} | endpoint |"))
        assert "| 1.000 | 0.667 | 0.333 | 0.000 | 3.00 |" in row


def test_chat_api_sends_the_messages(serve, sets, verifier, tmp_path):
    fake = serve()
    result = bench(fake, verifier, tmp_path, [sets["mtbench"], sets["chat"]], api="chat", max_tokens=8)
    sent = [b["messages"] for b in fake.sent("/v1/chat/completions")]
    assert not fake.sent()  # nothing went to /v1/completions
    # MT-bench: the first turn alone (the second asks about an answer the file does not hold); chat: the
    # turns before the first assistant reply.
    assert sent == [[{"role": "user", "content": f"Write a haiku about {t}."}]
                    for t in TOPICS] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."}],
        [{"role": "user", "content": "What is 2+2?"}]]
    assert [d["runs"][0]["spec"]["mean_acceptance_length"] for d in result["datasets"]] == [MEAN_LENGTH] * 2
    assert [d["runs"][0]["tokens"] for d in result["datasets"]] == [5 * 8, 2 * 8]


def test_compare_endpoint_gives_the_speedup(serve, sets, verifier, tmp_path):
    fast, plain = serve(), serve(spec=False)
    warnings = []
    result = bench(fast, verifier, tmp_path, [sets["humaneval"]], warn=warnings.append, compare_endpoint=plain.url,
                   max_tokens=8)
    assert warnings == []  # the compared server needs no spec decode
    (d,) = result["datasets"]
    ours, theirs = d["runs"]
    assert (ours["server"], theirs["server"]) == ("endpoint", "compare")
    assert theirs["spec"] is None and ours["spec"]["mean_acceptance_length"] == MEAN_LENGTH
    assert d["speedup"] == theirs["speedup_of_endpoint"] == ours["tokens_per_s"] / theirs["tokens_per_s"]
    assert [b["prompt"] for b in plain.sent()] == [b["prompt"] for b in fast.sent()]  # the same prompts
    assert f"| {d['speedup']:.2f}x |" in (tmp_path / "bench.md").read_text()


def test_each_servers_vllm_version_and_model_runner_are_recorded_as_it_reports_them(serve, sets, verifier, tmp_path):
    """The runner from serve-draft's GET /dspark/server (vLLM's own config); a server without it records None."""
    served, other = serve(runner="v2"), serve(spec=False)
    bench(served, verifier, tmp_path, [sets["humaneval"]], compare_endpoint=other.url, max_tokens=8)
    servers = json.loads((tmp_path / "bench.json").read_text())["servers"]
    assert [(s["vllm_version"], s["vllm_model_runner"]) for s in servers] == [("0.33.0", "v2"), ("0.33.0", None)]


def test_server_without_spec_decode_warns_once(serve, sets, verifier, tmp_path):
    fake = serve(spec=False)
    proc = run_cli(*bench_args(fake.url, verifier, tmp_path, sets["humaneval"], max_tokens=8))
    line = one_line(proc.stderr, "warning:")
    assert fake.url in line and "without speculative decoding" in line
    md = (tmp_path / "bench.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| HumanEval | endpoint |"))
    assert "no spec decode" in row and "0.000" not in row
    assert json.loads((tmp_path / "bench.json").read_text())["datasets"][0]["runs"][0]["requests"] == 2


# --- servers that cannot be measured: one line each -----------------------------------------------------

@pytest.mark.parametrize("endpoint", ["closed", "ftp://127.0.0.1:8000"])
def test_bad_endpoint_is_one_error_line(endpoint, sets, verifier, tmp_path):
    url = f"http://127.0.0.1:{free_port()}" if endpoint == "closed" else endpoint
    proc = run_cli(*bench_args(url, verifier, tmp_path, sets["humaneval"]), check=False)
    assert proc.returncode == 2
    line = one_line(proc.stderr, "error:")
    assert url in line and "fix:" in line


def test_non_vllm_server_is_one_error_line(serve, sets, verifier, tmp_path):
    fake = serve(vllm=False)
    proc = run_cli(*bench_args(fake.url, verifier, tmp_path, sets["humaneval"]), check=False)
    assert proc.returncode == 2
    line = one_line(proc.stderr, "error:")
    assert f"{fake.url}/metrics" in line and "not a vLLM server" in line
    assert not fake.posts  # refused before any request was sent


def test_server_down_mid_run_is_one_error_line(serve, sets, verifier, tmp_path):
    fake = serve(die_after=3)  # the warm-up request and 2 of the set's 5
    proc = run_cli(*bench_args(fake.url, verifier, tmp_path, f"mt={sets['mtbench']}", max_tokens=8), check=False)
    assert proc.returncode == 2
    line = one_line(proc.stderr, "error:")
    assert fake.url in line and "request 3 of set mt failed" in line and "after 2 of 5 completed" in line
    assert not (tmp_path / "bench.json").exists()


def test_chat_api_refuses_a_prepared_folder(serve, prepared, verifier, tmp_path):
    fake = serve()
    proc = run_cli(*bench_args(fake.url, verifier, tmp_path, prepared, api="chat"), check=False)
    assert proc.returncode == 2
    line = one_line(proc.stderr, "error:")
    assert f"prompt set {prepared.name} is a prepared folder" in line and "--api completions" in line
    assert not fake.posts


def test_an_error_reported_mid_stream_fails_the_request(serve, sets, verifier, tmp_path):
    # vLLM sends {"error": ...} and then [DONE]: not a completed request.
    fake = serve(stream_error="engine dead")
    with pytest.raises(BenchError, match="a first short request failed \\(the server reported: engine dead\\)"):
        bench(fake, verifier, tmp_path, [sets["humaneval"]])


def test_prompts_longer_than_the_server_takes(serve, sets, verifier, tmp_path):
    fake = serve()
    longbench = write_jsonl(tmp_path / "longbench.jsonl",
                            [{"context": "word " * 2000, "input": "Why?", "dataset": "qa"}])
    # A LongBench set may be all too long: reported with no request, the next set still measured.
    result = bench(fake, verifier, tmp_path, [longbench, sets["humaneval"]], max_tokens=16)
    lb, he = result["datasets"]
    assert (lb["prompts"], sum(lb["too_long"].values()), lb["runs"][0]["requests"]) == (0, 1, 0)
    assert he["runs"][0]["requests"] == 2 and he["runs"][0]["spec"]["mean_acceptance_length"] == MEAN_LENGTH
    with pytest.raises(InputError, match="every prompt is longer than the server's max_model_len"):
        bench(fake, verifier, tmp_path, [longbench], max_tokens=16)
    with pytest.raises(InputError, match=f"--max-tokens {MAX_MODEL_LEN} leaves no room .* max_model_len"):
        bench(fake, verifier, tmp_path, [sets["humaneval"]], max_tokens=MAX_MODEL_LEN)
