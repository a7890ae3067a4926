"""The live path against a real mooncake_master on loopback and a real `dspark serve`."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import LAYERS, fit, run_cli, train_cfg, wait_for
from services import Service, small_cfg, start_extractor, start_master, stop
from dspark.verifier.resolved import Verifier
from dspark.connector.base import Sample
from dspark.connector.registry import SOURCES
from dspark.connector.live import LiveConfig, LiveSourceDown
from dspark.connector.manifest import StoreManifest, manifest_for_model
from dspark.connector.config import MooncakeConfig
from dspark.connector.mooncake.client import connect
from dspark.connector.mooncake.errors import CorruptObject, MooncakeFull, MooncakeUnavailable
from dspark.connector.mooncake.reader import MooncakeReader
from dspark.connector.mooncake.sink import MooncakeSink
from dspark.connector.mooncake.wire import object_key, pack, sample_key
from dspark.connector.zarr.reader import ZarrStore
from dspark.core.net import free_port
from dspark.data.prepare import PreparedData

pytest.importorskip("mooncake.store", reason="install the mooncake extra: pip install -e '.[mooncake]'")
pytestmark = pytest.mark.slow  # every test here starts or reads real services (master, serve, vLLM)

GIB = 1 << 30


@pytest.fixture
def master(live_master):
    """The session's Mooncake master (services.py): each test here writes keys of its own, see `manifest`."""
    return live_master.up()


@pytest.fixture(params=["serve", "vllm"])
def served(request):
    """The session's extractor of each engine, on the session master: one start each, however many tests read."""
    return request.getfixturevalue({"serve": "live_serve", "vllm": "live_vllm"}[request.param]).up()


LIVE_KEYS = {"on_missing", "on_generate", "request_timeout", "max_retries", "generation_validation_retries",
             "max_consecutive_generation_failures", "stall_timeout", "max_down_seconds"}


def live_cfg(store, prepared, verifier, save, master, endpoint=None, **kw):
    live = {k: kw.pop(k) for k in list(kw) if k in LIVE_KEYS}
    return train_cfg(store, prepared, verifier, save, source="mooncake", **kw,
                     live={"endpoint": endpoint, "mooncake": {"master": master, "global_segment_gib": 0.0625,
                                                              "local_buffer_gib": 0.0625}, **live})


@pytest.mark.slow
def test_live_training_matches_zarr_training_and_caches_everything(tmp_path, verifier, prepared, master, served):
    """Shares the session's master and extractor; slow as its claim is: a live training, a Zarr one, a replay."""
    cache = tmp_path / "cache"
    c = live_cfg(cache, prepared, verifier, tmp_path / "live", master, served, on_generate="delete")
    live = fit(c)
    epoch_end = {r["epoch"]: r["live"]["requests"] for r in live if r["split"] == "train"}
    assert epoch_end[0] > 0 and epoch_end[1] == epoch_end[0]  # the second epoch asks for nothing
    assert run_cli("store", "verify", cache, "--no-progress").returncode == 0
    # Training from a Zarr store holding the same samples gives the same metrics, bit for bit...
    offline = fit(replace(c, source="zarr", save_path=str(tmp_path / "offline")))
    assert [r["metrics"] for r in offline] == [r["metrics"] for r in live]
    # ...and the live run replays offline, from its cache alone.
    out = run_cli("replay", tmp_path / "live", "--no-progress").stdout
    assert "REPRODUCED" in out


def live_source(cache, verifier, prepared, master, endpoint, **live):
    """The trainer's live source in this process, mounting 64 MiB (a serve started with segment 0 puts there)."""
    data = PreparedData(prepared)
    cfg = LiveConfig(endpoint=endpoint, mooncake=replace(small_cfg(64), master=master), **live)
    manifest = manifest_for_model(Verifier.resolve(verifier), LAYERS, data.fingerprint, encoding="raw")
    return data, SOURCES["mooncake"](store=cache, manifest=manifest, prompts=data, live=cfg)


@pytest.fixture(scope="module")
def quiet(tmp_path_factory, verifier, prepared):
    """A master of this module's own, on which no client but a test's live source mounts memory, and a
    `dspark serve` on it that mounts none (its puts go to the trainer's segment, so stopping or killing it
    loses nothing): one start each for the outage tests, which all leave the server running or dead."""
    logs = tmp_path_factory.mktemp("quiet")
    master_proc, master = start_master(logs)

    def start():
        return start_extractor(logs, verifier, prepared, master, "serve", serve_segment_gib=0)

    server = Service(*start(), logs, start)
    yield Service(master_proc, master, logs), server
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGCONT)
    stop(server.proc, signal.SIGTERM)
    stop(master_proc)


@pytest.fixture
def served_alone(quiet):
    """(the quiet server's process, its URL, its master): started again if an earlier test killed it (the
    dead-server test does), resumed if one left it stopped. Its keys need no namespace: every live source
    here has a cache of its own, so it requests each sample it reads and the server replaces the object."""
    master, server = quiet
    yield server.proc, server.up(), master.up()
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGCONT)


def test_a_producer_that_mounts_no_memory_puts_into_the_trainers_at_once(tmp_path, verifier, prepared,
                                                                         served_alone):
    """The trainer mounts its segment before its first request: otherwise that put had nowhere to go
    until a timeout (the first live read of a resumed Slurm job stalled for a minute). The quiet master:
    on the session's, another client's segment would take the put and hide a trainer that mounts late."""
    _, url, master = served_alone
    data, source = live_source(tmp_path / "cache", verifier, prepared, master, url, request_timeout=10,
                               max_retries=0)
    sample = source.read(0)
    assert sample is not None and np.array_equal(sample.token_ids, data.token_ids(0))
    assert (source.stats["generated"], source.stats["requests"], source.stats["failures"]) == (1, 1, 0)
    source.close()


STALL = 2.0  # --stall-timeout of the hung-server tests
SLACK = 3.0  # what a loaded 2-core machine may add to a bound


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "dspark.live")


def test_a_hung_server_degrades_the_live_source_within_the_stall_timeout_and_reads_resume_when_it_answers(
        tmp_path, verifier, prepared, served_alone, caplog):
    """SIGSTOP: the kernel still accepts the server's connections, so only a liveness check tells a hung
    server from a slow one; a read must not wait out --request-timeout (and its retries) on it."""
    proc, url, master = served_alone
    caplog.set_level(logging.WARNING, "dspark.live")
    _, source = live_source(tmp_path / "cache", verifier, prepared, master, url, request_timeout=60,
                            stall_timeout=STALL)
    try:
        assert source.read(0) is not None
        os.killpg(proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        assert source.read(1) is None  # its request is in flight when the server hangs
        assert time.monotonic() - t < STALL + SLACK
        assert "live source degraded" in _warnings(caplog) and "liveness check" in _warnings(caplog)
        asked = source.stats["requests"]
        t = time.monotonic()
        assert [source.read(i) for i in range(2, 10)] == [None] * 8  # while it is down, misses are skipped at once
        assert time.monotonic() - t < 1.0 and source.stats["requests"] == asked
        assert source.read(0) is not None  # cached samples keep training
        os.killpg(proc.pid, signal.SIGCONT)
        wait_for(lambda: source.read(10) is not None, STALL + SLACK, "live reads to resume")
    finally:
        source.close()
    said = _warnings(caplog)
    assert said.count("live source degraded") == 1 and "live source is back" in said
    assert source.stats["skipped"] >= 9


def test_a_run_that_skipped_samples_records_them_and_its_replay_leaves_the_same_ones_out(
        tmp_path, verifier, prepared, served_alone, caplog):
    """The server hangs before the run starts and comes back once the run says so. The cache holds every
    sample but one of the first batch (skipped: the batch trains on the rest) and the whole second batch
    (no sample left: it waits for the server instead of being skipped). The skipped one is fetched in the
    next epoch, so the cache the replay reads holds it: the replay reproduces the run only by leaving it
    out where the run did. Shares the quiet server (and resumes it); slow as its claim is: a run, two replays."""
    from dspark.replay import replay
    from dspark.train.config import ReplayConfig
    from dspark.train.data import TrainData

    proc, url, master = served_alone
    c = live_cfg(tmp_path / "cache", prepared, verifier, tmp_path / "run", master, url, request_timeout=60,
                 stall_timeout=STALL)
    data, source = live_source(tmp_path / "cache", verifier, prepared, master, url)
    first, second = TrainData(source, data, c.total_seq_len, c.train_data_ratio, c.seed,
                              c.on_damaged).epoch_batches(0)[:2]
    skip, wait = first[-1], set(second)
    for i in set(range(len(data))) - {skip} - wait:
        assert source.read(i) is not None
    source.close()

    class ResumeOnceDegraded(logging.Handler):
        def emit(self, record):
            if "live source degraded" in record.getMessage():
                os.killpg(proc.pid, signal.SIGCONT)

    caplog.set_level(logging.WARNING, "dspark.live")
    handler = ResumeOnceDegraded()
    logging.getLogger("dspark.live").addHandler(handler)
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        fit(c)
    finally:
        logging.getLogger("dspark.live").removeHandler(handler)
    assert _warnings(caplog).count("live source degraded") == 1
    skipped = {"train epoch 0": [skip]}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["skipped"] == skipped
    assert len(ZarrStore(tmp_path / "cache")) == len(data)  # the skipped one was fetched in epoch 1
    result = replay(ReplayConfig(run=str(tmp_path / "run")), progress=False)
    assert result["reproduced"], result["first_divergence"]
    assert result["skipped"] == skipped
    assert result["note"] == (f"the run skipped 1 sample it could not read (train epoch 0: {skip}); the replay "
                              "left the same ones out")
    # A record without the list (a run from before it was kept): the replay reads the sample, and says why it differs.
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    del record["skipped"]
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    result = replay(ReplayConfig(run=str(tmp_path / "run")), progress=False)
    assert not result["reproduced"]
    assert result["first_divergence"].startswith("record 0 (step 1, train): ")
    assert "the run skipped samples its live source could not deliver" in result["first_divergence"]


def test_a_dead_server_is_waited_out_for_max_down_seconds_so_a_restart_resumes_live_reads(
        tmp_path, verifier, prepared, served_alone, caplog):
    """Failing fast, a dead server used up a count of failures in seconds; the budget is time. Kills the quiet
    server (the next test to ask gets a fresh one) and starts one on its port: that restart is the claim."""
    proc, url, master = served_alone
    caplog.set_level(logging.WARNING, "dspark.live")
    _, source = live_source(tmp_path / "cache", verifier, prepared, master, url, max_retries=1,
                            max_consecutive_generation_failures=8, max_down_seconds=120)
    try:
        assert source.read(0) is not None
        stop(proc)  # SIGKILL: its connections are refused
        t = time.monotonic()
        assert [source.read(i) for i in range(1, 31)] == [None] * 30  # far more misses than 8
        assert time.monotonic() - t < SLACK
        restarted, _ = start_extractor(tmp_path, verifier, prepared, master, "serve", serve_segment_gib=0,
                                       port=urllib.parse.urlsplit(url).port)
        try:
            wait_for(lambda: source.read(31) is not None, 1 + SLACK, "live reads to resume after the restart")
        finally:
            stop(restarted)
    finally:
        source.close()
    said = _warnings(caplog)
    assert said.count("live source degraded") == 1 and "live source is back" in said
    # Down past --max-down-seconds, the run stops in one line that names the setting.
    _, short = live_source(tmp_path / "cache2", verifier, prepared, master, url, max_down_seconds=STALL)
    said = r"the live source has been down for 2 s, more than --max-down-seconds 2 \(the extraction server at "
    try:
        t = time.monotonic()
        with pytest.raises(LiveSourceDown, match=said + r"http://127.0.0.1:\d+/v1 does not answer its liveness"):
            for i in range(10_000):
                short.read(i)
                time.sleep(0.01)
        assert STALL <= time.monotonic() - t < STALL + SLACK
    finally:
        short.close()


def test_producer_driven_tee_to_zarr_and_mooncake(tmp_path, verifier, prepared, master):
    store = tmp_path / "store"
    # The consumer contributes the memory; the producer mounts none, so what it
    # published outlives it (objects live in the segments of the clients that mount them).
    holder = MooncakeSink(_manifest(), replace(small_cfg(256), master=master))
    run_cli("extract", "--to", "zarr,mooncake", "--model", verifier, "--data", prepared, "--store", store,
            "--target-layer-ids", *LAYERS, "--mooncake-master", master, "--mooncake-global-segment-gib", "0",
            "--no-progress")
    z = ZarrStore(store)
    reader = MooncakeReader(z.manifest, replace(small_cfg(), master=master, global_segment_gib=0))
    for i in z.sample_ids[:: max(1, len(z) // 10)]:
        a, b = z.read(i), reader.get(i, timeout=5)
        assert np.array_equal(a.token_ids, b.token_ids)
        assert torch.equal(a.hidden_states.view(torch.int16), b.hidden_states.view(torch.int16))
    # A consumer without an endpoint trains from what the producer streamed, writing it through.
    records = fit(live_cfg(tmp_path / "cache", prepared, verifier, tmp_path / "run", master, epochs=1,
                           max_steps=3, request_timeout=5, max_consecutive_generation_failures=1000))
    assert records and all(np.isfinite(r["metrics"]["loss"]) for r in records)
    assert holder.samples_written == 0


def _manifest(prepared_fingerprint: str = "p") -> StoreManifest:
    return StoreManifest(verifier_name="t", verifier_config_hash="c", tokenizer_hash="t", target_layer_ids=[1],
                         num_hidden_layers=2, hidden_size=16, dtype="bfloat16", chunk_tokens=16,
                         prepared_fingerprint=prepared_fingerprint)


@pytest.fixture
def manifest() -> StoreManifest:
    """A store identity of the test's own: Mooncake keys are scoped by it, so tests sharing the master never meet."""
    return _manifest(uuid.uuid4().hex)


def _sample(i, n=12) -> Sample:
    return Sample(i, np.arange(n, dtype=np.int64), torch.randn(n, 2, 16).to(torch.bfloat16))


def test_error_marker_fails_fast(master, manifest):
    sink = MooncakeSink(manifest, replace(small_cfg(32), master=master))
    sink.write_error(sample_key(manifest, 7), "CUDA out of memory")
    reader = MooncakeReader(manifest, replace(small_cfg(32), master=master, global_segment_gib=0))
    t = time.monotonic()
    with pytest.raises(Exception, match="CUDA out of memory"):
        reader.get(7, timeout=30)
    assert time.monotonic() - t < 2


def test_a_producer_that_mounts_memory_puts_into_its_own_segment(master, manifest):
    """A local memcpy instead of a network transfer; the consumer's fetch is the one crossing (and the
    producer's back-pressure budget counts the segment its objects are actually in)."""
    m = manifest
    others = [connect(replace(small_cfg(32), master=master)) for _ in range(3)]  # segments the master could pick
    sink = MooncakeSink(m, replace(small_cfg(32), master=master))
    reader = MooncakeReader(m, replace(small_cfg(32), master=master, global_segment_gib=0))
    samples = [_sample(i) for i in range(12)]
    transfers = [sink.put(s) for s in samples]
    client = sink.store.client
    where = {client.get_replica_desc(object_key(m, s))[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
             for s in samples}
    assert len(where) == 1  # all in one segment: random placement over 4 would spread 12 objects
    for s, tr in zip(samples, transfers):
        assert torch.equal(reader.get(s.sample_id, tr, timeout=2).hidden_states, s.hidden_states)
    del others


def test_out_of_space_is_a_clear_error(master, manifest):
    sink = MooncakeSink(manifest, replace(small_cfg(16), master=master, put_timeout=0.5))
    with pytest.raises(MooncakeFull, match="--mooncake-global-segment-gib"):
        for i in range(10_000):
            sink.put(_sample(i, n=4096))  # 256 KiB each into a 16 MiB segment, nobody consuming
    assert 10 < sink.samples_written < 64


def test_corrupted_objects_are_rejected(master, manifest):
    m = manifest
    sink = MooncakeSink(m, replace(small_cfg(32), master=master))
    reader = MooncakeReader(m, replace(small_cfg(32), master=master, global_segment_gib=0))
    good = _sample(1)
    transfer = sink.put(good)
    assert torch.equal(reader.get(1, transfer, timeout=2).hidden_states, good.hidden_states)
    buf, _ = pack(good, m, object_key(m, good))
    bad = [("truncated", buf[:-64], "has .* bytes, its manifest says"),
           ("flipped", np.where(np.arange(len(buf)) == 5, buf ^ 0xFF, buf).astype(np.uint8), "checksum")]
    for name, data, match in bad:
        key = f"bad/{name}"
        sink.store.put(key, data)
        with pytest.raises(CorruptObject, match=match):
            reader.get(1, {**transfer, "handle": key}, timeout=2)
    other = m.model_copy(update={"hidden_size": 32})
    with pytest.raises(CorruptObject, match="another store"):
        MooncakeReader(other, replace(small_cfg(32), master=master, global_segment_gib=0)).get(1, transfer, timeout=2)


@pytest.mark.timeout(120)  # the bound the trainer's child process had: refused at once, not after retries
def test_unreachable_master_is_one_clear_line(verifier, prepared, tmp_path):
    with pytest.raises(MooncakeUnavailable, match="cannot reach the Mooncake master at 127.0.0.1:1"):
        connect(MooncakeConfig(master="127.0.0.1:1"))
    proc = run_cli("extract", "--to", "mooncake", "--model", verifier, "--data", prepared, "--target-layer-ids",
                   *LAYERS, "--mooncake-master", "127.0.0.1:1", check=False)
    assert proc.returncode == 2 and "cannot reach the Mooncake master" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The trainer says so before it trains (or waits on an endpoint that is away too), not after its retries.
    # In this process: nothing is killed under this run, so its exit code and stderr are the CLI's alone.
    train = run_cli(*_train_args(tmp_path, verifier, prepared, "127.0.0.1:1",
                                 f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"), check=False)
    out, err = train.stdout, train.stderr
    assert train.returncode == 2 and err.startswith("error: cannot reach the Mooncake master at 127.0.0.1:1"), err


def _train_args(tmp_path, verifier, prepared, master, endpoint, **flags) -> list[str]:
    args = ["train", "--from", "mooncake", "--cache", tmp_path / "cache",
            "--data-path", prepared, "--verifier-name-or-path", verifier, "--save-path", tmp_path / "run",
            "--target-layer-ids", *map(str, LAYERS), "--max-anchors", "32", "--markov-rank", "16",
            "--total-seq-len", "512", "--epochs", "1", "--no-progress", "--mooncake-master", master,
            "--mooncake-global-segment-gib", "0.0625", "--mooncake-local-hostname", "localhost",
            "--vllm-endpoint", endpoint]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return [str(a) for a in args]


def _train_proc(tmp_path, verifier, prepared, master, endpoint, **flags):
    """`dspark train` in a child process: the services it reads die under it while it runs, and its exit code
    and stderr are the claim (in this process, the test could not kill a server while its run waits on it)."""
    return subprocess.Popen([sys.executable, "-m", "dspark.cli", *_train_args(tmp_path, verifier, prepared, master,
                                                                               endpoint, **flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _cached(tmp_path) -> int:
    try:
        return len(ZarrStore(tmp_path / "cache"))
    except Exception:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["serve", "master", "vllm"])
def test_losing_a_live_service_mid_run_degrades_then_stops_clearly(tmp_path, verifier, prepared, victim, request):
    """Slow as the claim is: a run in a process of its own (`_train_proc`) fetches 10 live samples, loses a
    service and stops. The serve and vllm victims kill the session's extractor (the next test to ask for it
    gets a fresh one); the master victim kills a master, so it has one of its own and a server on it."""
    if victim == "master":
        master_proc, master = start_master(tmp_path)
        serve_proc, url = start_extractor(tmp_path, verifier, prepared, master, "serve")
    else:  # the run's cache is its own, so it requests every sample it reads from the shared server
        master_proc, master = None, request.getfixturevalue("master")
        shared = request.getfixturevalue(f"live_{victim}")
        url = shared.up()
        serve_proc = shared.proc
    try:
        train = _train_proc(tmp_path, verifier, prepared, master, url, request_timeout=3, max_retries=1,
                            max_consecutive_generation_failures=3, max_down_seconds=2)
        wait_for(lambda: _cached(tmp_path) >= 10 or train.poll() is not None, 180, "live samples in the cache")
        stop(master_proc) if victim == "master" else stop(serve_proc, signal.SIGTERM)
        out, err = train.communicate(timeout=300)
        # Either it finished on what it had (training continued on the cache) or it stopped clearly: a server
        # that is gone after --max-down-seconds, one whose requests fail (no master) after 3 failures.
        stopped = "the live source has been down for" in err or "consecutive live extraction failures" in err
        assert train.returncode == 0 or (train.returncode == 2 and stopped and "Traceback" not in err), err[-2000:]
        assert "live source degraded" in err
        assert run_cli("store", "verify", tmp_path / "cache", "--no-progress").returncode == 0
        # What other nodes reach the trainer at (multi-node runs set the node's name) is recorded.
        recorded = json.loads((tmp_path / "run" / "config.json").read_text())
        assert recorded["train"]["live"]["mooncake"]["local_hostname"] == "localhost"
    finally:
        stop(serve_proc, signal.SIGTERM)
        if master_proc is not None:
            stop(master_proc)


def test_a_source_that_gives_up_stops_the_loader_without_the_reads_queued_behind_it():
    """The lost-master run above once stopped only after every read queued behind the one that gave up had
    waited out its request timeout and retry (30 s of its 70): a read in flight finishes, the rest are dropped."""
    from dspark.train.data import Loader

    started = []

    class Data:  # what a Loader asks of TrainData
        leave_out: dict = {}

        def holds(self, ids):
            return False

        def read(self, sample_id):
            started.append(sample_id)
            if sample_id == 0:
                raise LiveSourceDown("the live source gave up")
            time.sleep(0.5)  # a live read waiting on its request
            return None

        def collate(self, samples):
            return None

    with pytest.raises(LiveSourceDown, match="gave up"):
        list(Loader(Data(), [[0, 1], [2, 3], [4, 5]], num_workers=1, prefetch=1, keep_empty=True))
    assert started[0] == 0 and len(started) <= 2, started  # 0 failed, 1 was in flight; 2-5 never started


def test_an_object_that_vanished_is_named_as_such(master):
    from dspark.connector.mooncake.errors import ObjectGone

    reader = MooncakeReader(_manifest(), replace(small_cfg(32), master=master))
    with pytest.raises(ObjectGone, match="lease expired"):
        reader.store.get("dspark/never/written")


def test_a_reply_cut_off_mid_send_is_a_connection_error():
    """A server killed while sending (SIGTERM in the middle of a reply) is unreachable to every caller's retry and
    down-budget handling, not a crash: http.client's IncompleteRead is no OSError."""
    import http.server
    import threading

    from dspark.connector.live import ExtractionClient

    class CutOff(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1269")
            self.end_headers()
            self.wfile.write(b'{"choices"')  # then the connection closes

        def log_message(self, *args):  # keep pytest's output clean
            return

    server = http.server.HTTPServer(("127.0.0.1", 0), CutOff)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ExtractionClient(f"http://127.0.0.1:{server.server_port}/v1", timeout=10, stall_timeout=4,
                                  prepared_fingerprint="x")
        client.model = "m"
        with pytest.raises(ConnectionError, match="broke off its reply: IncompleteRead"):
            client.extract(0, [1, 2, 3])
    finally:
        server.shutdown()
