import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import LAYERS, run_cli
from dspark.connector.zarr_store import ZarrStore, _RECORD
from dspark.extract.transformers_engine import TransformersEngine
from dspark.prepare import PreparedData


def test_states_equal_a_direct_transformers_forward(verifier, prepared):
    data = PreparedData(prepared)
    engine = TransformersEngine(verifier, LAYERS)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.bfloat16).eval()
    ids = [data.sample(i)[0] for i in range(4)]
    batched = engine.extract(ids)
    for tok, got_batched in zip(ids, batched):
        got = engine.extract([tok])[0]
        assert got.shape == (len(tok), len(LAYERS) + 1, 128) and got.dtype == torch.bfloat16
        post_norm = {}
        hook = model.model.norm.register_forward_hook(lambda m, i, o: post_norm.setdefault("x", o))
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(tok)[None], output_hidden_states=True)
        hook.remove()
        for j, k in enumerate(LAYERS):
            assert torch.equal(got[:, j], out.hidden_states[k][0])
        last = got[:, -1]
        # The last captured layer is the residual stream *before* the final norm...
        assert not torch.allclose(last.float(), post_norm["x"][0].float(), atol=1e-2)
        assert torch.equal(model.model.norm(last[None])[0], post_norm["x"][0])
        # ...and right-padding a batch does not change the valid positions.
        torch.testing.assert_close(got_batched, got, atol=2e-2, rtol=2e-2)


def test_layer_id_out_of_range_is_one_clear_line(verifier, prepared, tmp_path):
    proc = run_cli("extract", "--model", verifier, "--data", prepared, "--store", tmp_path / "s",
                   "--target-layer-ids", "1", "9", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: target layer id(s) [9] out of range for a verifier with 6 layers (fix: use ids in 0..6 (0 = embeddings))"]


def test_tensor_parallel_needs_the_vllm_engine(verifier, prepared, tmp_path):
    proc = run_cli("extract", "--model", verifier, "--data", prepared, "--store", tmp_path / "s",
                   "--target-layer-ids", "1", "--tensor-parallel-size", "2", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --tensor-parallel-size 2 needs the vllm engine (fix: pass --engine vllm, or run one process per "
        "device with --shard INDEX/COUNT)"]


def test_store_of_other_inputs_is_refused(verifier, prepared, store, tmp_path):
    proc = run_cli("extract", "--model", verifier, "--data", prepared, "--store", store,
                   "--target-layer-ids", "2,4", "--no-progress", check=False)
    assert proc.returncode == 2 and "target_layer_ids: store has [1, 3, 5], wanted [2, 4]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_folder_of_other_files_is_not_taken_over_as_a_store(verifier, prepared, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"meow")
    proc = run_cli("extract", "--model", verifier, "--data", prepared, "--store", folder,
                   "--target-layer-ids", *LAYERS, "--no-progress", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {folder} is not empty and is not a dspark store (no manifest.json; it holds cat.jpg) (fix: use a "
        "new or empty folder for a new store, or the folder of an existing store)"]
    assert sorted(p.name for p in folder.iterdir()) == ["cat.jpg"]


def _records(root) -> int:
    return sum((p / "index.bin").stat().st_size // _RECORD.size
               for p in (root / "segments").iterdir() if (p / "index.bin").exists()) if (root / "segments").exists() else 0


def _extract_cmd(verifier, prepared, root):
    return [sys.executable, "-m", "dspark.cli", "extract", "--model", str(verifier), "--data", str(prepared),
            "--store", str(root), "--target-layer-ids", *map(str, LAYERS), "--batch-tokens", "512",
            "--chunk-tokens", "64", "--no-progress"]


@pytest.mark.slow
def test_kill_9_at_several_points_then_resume_is_byte_identical(verifier, prepared, tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(_extract_cmd(verifier, prepared, reference), check=True, capture_output=True)
    total = len(PreparedData(prepared))
    root = tmp_path / "killed"
    for kill_at in (0, total // 4, total // 2, 3 * total // 4):
        proc = subprocess.Popen(_extract_cmd(verifier, prepared, root), stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while _records(root) <= kill_at and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert run_cli("store", "verify", root, "--no-progress").returncode == 0
    assert len(ZarrStore(root)) < total  # the kills really landed mid-run
    out = run_cli("extract", "--model", verifier, "--data", prepared, "--store", root, "--target-layer-ids",
                  *LAYERS, "--batch-tokens", 512, "--chunk-tokens", 64, "--no-progress").stdout
    assert '"already_present"' in out
    assert run_cli("store", "verify", root, "--no-progress").returncode == 0
    a, b = ZarrStore(reference), ZarrStore(root)
    assert a.sample_ids == b.sample_ids == list(range(total))
    for i in a.sample_ids:
        x, y = a.read(i), b.read(i)
        assert (x.token_ids == y.token_ids).all()
        assert torch.equal(x.hidden_states.view(torch.int16), y.hidden_states.view(torch.int16))
    # a finished store: a rerun extracts nothing
    assert '"extracted": 0' in run_cli(*_extract_cmd(verifier, prepared, root)[3:]).stdout


def test_store_info_reports_sizes(store):
    import json
    info = json.loads(run_cli("store", "info", store).stdout)
    assert info["samples"] == len(ZarrStore(store)) > 0
    assert info["raw_bytes"] == info["tokens"] * 4 * 128 * 2 and info["ratio"] > 1.2
    assert info["manifest"]["target_layer_ids"] == LAYERS
