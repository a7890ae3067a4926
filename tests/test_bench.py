"""`dspark bench` against a fake vLLM: an OpenAI-compatible server on a free local port whose /metrics
speaks vLLM's Prometheus text and whose spec-decode counters move by a scripted amount per request,
so every figure the bench reports is known exactly. Broken servers (no spec decode, not vLLM, dying
mid-run, not there at all) must each end in one readable line.
"""

import base64
import copy
import json
import resource
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import run_cli, run_process, write_jsonl

from dspark.serving.bench import client
from dspark.serving.bench.client import BenchError
from dspark.serving.bench.metrics import Reading, SpecCounters, read
from dspark.serving.bench.run import WARMUP_TOKENS, BenchConfig, run_bench
from dspark.core.errors import InputError

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
    routes: dict = field(default_factory=dict)  # path -> reply(handler): a hostile answer in place of the usual one
    completion_tokens: int | None = None  # what each reply's usage says (default: its max_tokens)
    restart_after: int | None = None  # POSTs after which the counters start again from zero: a restart mid-bench
    extra_metrics: str = ""        # more lines at the end of /metrics
    posts: list[tuple[str, dict]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # each request's Authorization header
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
            if len(self.posts) - 1 == self.restart_after:
                self.counters = {"drafts": 0, "draft_tokens": 0, "per_pos": [0] * len(START["per_pos"])}
            self.prompt_tokens += len(body.get("prompt") or ())
            c = self.counters
            c["drafts"] += STEP["drafts"]
            c["draft_tokens"] += STEP["draft_tokens"]
            c["per_pos"] = [a + b for a, b in zip(c["per_pos"], STEP["per_pos"])]
            return True

    def metrics(self) -> str | None:
        with self.lock:
            text = metrics_text(self.counters if self.spec else None, self.prompt_tokens)
            return text + self.extra_metrics if self.vllm else None

    def sent(self, path: str = "/v1/completions") -> list[dict]:
        """The bench's request bodies to `path`, the warm-up request (always the first) left out."""
        return [b for p, b in self.posts[1:] if p == path]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # so a handler may close its own server without joining itself


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection, the reply ends when it closes

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _reply(self, code: int, ctype: str, body: str | bytes) -> None:
        data = body.encode() if isinstance(body, str) else body
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
        fake.auth.append(self.headers.get("Authorization"))
        if self.path in fake.routes:
            fake.routes[self.path](self)
        elif self.path == "/v1/models":
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
        fake.auth.append(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in fake.routes:
            fake.take(self.path, body)
            return fake.routes[self.path](self)
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
        tokens = body["max_tokens"] if fake.completion_tokens is None else fake.completion_tokens
        self._event({"choices": [], "usage": {"prompt_tokens": len(body.get("prompt") or ()),
                                              "completion_tokens": tokens}})
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
    return run_bench(BenchConfig(endpoint=kw.pop("endpoint", fake.url), prompts=[str(p) for p in prompts],
                                 tokenizer=str(verifier), output=str(tmp_path), **kw), progress=False, warn=warn)[0]


def one_line(stderr: str, prefix: str) -> str:
    """The one line stderr holds, which must start with `prefix`."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


def prompt_ids(verifier, path, **kw) -> list[tuple[int, ...]]:
    """What `dspark eval --decode` would decode for this file: the ids the completions API must be sent."""
    from dspark.data.prompts import load_prompt_set
    from dspark.data.prepare import load_tokenizer

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


# --- hostile servers and inputs: every read bounded, every count checked, each one line (issue 41) -------

LORIS_SECONDS = 8  # a slow loris hangs up after this, so that even a client without a deadline ends
DEEP = b"[" * 100_000  # JSON nested deeper than Python's parser recurses


def endless(head: bytes, tail: bytes):
    """A 200 reply that never ends: `head`, then `tail` again and again until the client hangs up."""
    def reply(h):
        h.send_response(200)
        h.end_headers()
        try:
            h.wfile.write(head)
            while True:
                h.wfile.write(tail)
        except OSError:
            pass
    return reply


def trickle(head: bytes, drip: bytes):
    """A slow loris: `head`, then `drip` every 0.1 s (well inside any idle timeout), for LORIS_SECONDS."""
    def reply(h):
        h.send_response(200)
        h.end_headers()
        end = time.monotonic() + LORIS_SECONDS
        try:
            h.wfile.write(head)
            while time.monotonic() < end:
                h.wfile.write(drip)
                time.sleep(0.1)
        except OSError:
            pass
    return reply


def answer(body: bytes, ctype: str = "application/json"):
    return lambda h: h._reply(200, ctype, body)


def events(*chunks) -> bytes:
    """A streamed reply: each chunk as a `data:` event, then [DONE]."""
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n"
                    for c in (*chunks, b"[DONE]"))


def _at_most_1_5_gib():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))


def per_pos(position: str, value: str, engine: str = "1") -> str:
    return (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{engine}",model_name="{MODEL}",'
            f'position="{position}"}} {value}\n')


DRAFTS = 'vllm:spec_decode_num_drafts_total{{engine="{}",model_name="toy"}} {}\n'


@pytest.mark.parametrize("path, fake, says", [
    # a position no drafter reaches: before, a 300M-entry tuple (3.1 GB)
    ("/metrics", {"extra_metrics": per_pos("300000000", "1.0")}, 'position="300000000"}: a draft position past 255'),
    # two counters whose sum is infinite (before: an OverflowError traceback), one below zero (before: rc 0)
    ("/metrics", {"extra_metrics": DRAFTS.format(1, "1e308") + DRAFTS.format(2, "1e308")}, "is 1e+308, not a count"),
    ("/metrics", {"extra_metrics": DRAFTS.format(1, "-5.0")}, "is -5.0, not a count"),
    # an endless body (before: a MemoryError), a slow loris (before: read for as long as it dripped)
    ("/metrics", {"routes": {"/metrics": endless(b"vllm:x 1\n", b"#" * 65536)}}, "answered more than 16777216 bytes"),
    ("/metrics", {"routes": {"/metrics": trickle(b"vllm:x 1\n", b"#")}}, "not done within 1 s (--request-timeout)"),
    ("/v1/models", {"routes": {"/v1/models": trickle(b'{"data": ', b" ")}}, "not done within 1 s (--request-timeout)"),
    # JSON nested 100k deep (before: a RecursionError traceback), and of the wrong shape
    ("/v1/models", {"routes": {"/v1/models": answer(DEEP)}}, "nested deeper than 500 levels"),
    ("/v1/models", {"routes": {"/v1/models": answer(b'{"data": [{"id": 5}]}')}}, "lists no model"),
])
def test_a_hostile_server_is_one_line_before_any_request(path, fake, says, serve, sets, verifier, tmp_path):
    fake = serve(**fake)
    start = time.monotonic()
    proc = run_process(*bench_args(fake.url, verifier, tmp_path / "out", sets["humaneval"], request_timeout="1"),
                       why="a memory cap holds for a whole process", check=False, preexec_fn=_at_most_1_5_gib,
                       timeout=60)
    assert time.monotonic() - start < LORIS_SECONDS - 1
    assert proc.returncode == 2
    line = one_line(proc.stderr, "error:")
    assert f"{fake.url}{path}" in line and says in line and "fix:" in line
    assert not fake.posts and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fake, says", [
    # an endless line (before: a MemoryError) and a stream that never ends (before: as long as it dripped)
    ({"routes": {"/v1/completions": endless(b"data: ", b"x" * 65536)}}, "a streamed line is longer than 131072"),
    ({"routes": {"/v1/completions": trickle(b"", b"\n")}}, "not done within 1 s (--max-seconds)"),
    # JSON nested 100k deep (before: RecursionError) and of the wrong shape (before: AttributeError)
    ({"routes": {"/v1/completions": answer(events(DEEP))}}, "not JSON (nested deeper than 500 levels"),
    ({"routes": {"/v1/completions": answer(events({"choices": [], "usage": [1, 2]}))}},
     "a streamed chunk's usage is not"),
    ({"routes": {"/v1/completions": answer(events({"choices": "abc"}))}}, "a streamed chunk's choices is not"),
    ({"routes": {"/v1/completions": answer(events({"choices": [{"delta": "x"}]}))}},
     "a streamed chunk's choices[].delta"),
    # counts that are no counts (before: rc 0 with a negative or absurd tokens/s)
    ({"completion_tokens": -5}, "usage.completion_tokens is -5, not a count"),
    ({"completion_tokens": 1e308}, "usage.completion_tokens is 1e+308, not a count"),
])
def test_a_hostile_stream_fails_its_request_in_one_line(fake, says, serve, sets, verifier, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "MAX_LINE", 1 << 17)  # DEEP's line fits
    fake = serve(**fake)
    start = time.monotonic()
    with pytest.raises(BenchError) as e:
        bench(fake, verifier, tmp_path, [sets["humaneval"]], max_seconds=1, max_tokens=8)
    assert time.monotonic() - start < LORIS_SECONDS - 1
    assert "\n" not in str(e.value) and f"{fake.url}: a first short request failed ({says}" in str(e.value)
    assert not (tmp_path / "bench.json").exists()


def test_counters_that_go_backwards_are_a_restart_not_a_negative_count(serve, sets, verifier, tmp_path):
    fake = serve(restart_after=2)  # the warm-up and the set's first prompt, then the server starts afresh
    with pytest.raises(BenchError) as e:  # before: drafts -9 and a mean length below 1, rc 0
        bench(fake, verifier, tmp_path, [sets["humaneval"]], max_tokens=8)
    assert str(e.value) == (f"{fake.url}/metrics: vllm:spec_decode_num_drafts went back from 15 to 3 during set "
                            "HumanEval: the server restarted mid-bench (fix: rerun the bench once the server stays up)")
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("endpoint, says", [
    ("http://[::1", "--endpoint 'http://[::1' is not a URL (Invalid IPv6 URL)"),  # before: a ValueError traceback
    ("http://user:secret@127.0.0.1:{port}/", "cannot reach http://user:***@127.0.0.1:{port}/v1/models"),
])
def test_a_bad_or_secret_endpoint_is_one_line_without_the_password(endpoint, says, sets, verifier, tmp_path):
    port = free_port()
    proc = run_cli(*bench_args(endpoint.format(port=port), verifier, tmp_path, sets["humaneval"]), check=False)
    assert proc.returncode == 2
    assert says.format(port=port) in one_line(proc.stderr, "error:") and "secret" not in proc.stderr


def test_user_info_is_sent_as_credentials_and_never_shown(serve, sets, verifier, tmp_path):
    fake = serve()
    bench(fake, verifier, tmp_path, [sets["humaneval"]], max_tokens=8, endpoint=fake.url.replace("//", "//me:s3cret@"))
    assert set(fake.auth) == {"Basic " + base64.b64encode(b"me:s3cret").decode()}
    for name in ("bench.json", "bench.md"):
        text = (tmp_path / name).read_text()
        assert "s3cret" not in text and fake.url.replace("//", "//me:***@") in text


def test_an_output_that_is_a_file_is_refused_before_any_request(serve, sets, verifier, tmp_path):
    fake = serve()
    kept = tmp_path / "results.txt"
    kept.write_bytes(b"precious\n")
    proc = run_cli(*bench_args(fake.url, verifier, kept, sets["humaneval"]), check=False)
    assert proc.returncode == 2  # before: the whole bench ran, then a FileExistsError traceback
    line = one_line(proc.stderr, "error:")
    assert f"--output {kept}" in line and "not a folder" in line
    assert kept.read_bytes() == b"precious\n" and not fake.auth  # not one request sent


def test_prompts_nested_too_deep_are_one_line(serve, verifier, tmp_path):
    fake = serve()
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(DEEP + b"\n")
    proc = run_cli(*bench_args(fake.url, verifier, tmp_path / "out", deep), check=False)
    assert proc.returncode == 2  # before: a RecursionError traceback
    line = one_line(proc.stderr, "error:")
    assert str(deep) in line and "nested deeper than 500 levels" in line
    assert not fake.posts
