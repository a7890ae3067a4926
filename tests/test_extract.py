import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import LAYERS, run_cli, run_process
from dspark.connector.zarr.format import INDEX_RECORD
from dspark.connector.zarr.reader import ZarrStore
from dspark.decode.verifier import Verifier
from dspark.core.errors import InputError
from dspark.extract.transformers_engine import TransformersEngine
from dspark.data.prepare import PreparedData
from dspark.verifier.check import check_verifier_config


def test_states_equal_a_direct_transformers_forward(verifier, prepared):
    data = PreparedData(prepared)
    engine = TransformersEngine(verifier, LAYERS, device="cpu")
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


def _verifier_with(verifier, folder, **config):
    """A copy of the verifier whose config.json says otherwise; its weights are the tiny model's."""
    shutil.copytree(verifier, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _address_space(limit: int):
    """For a child process: fail any allocation past `limit` bytes instead of taking the machine's memory."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


IMPOSSIBLE_CONFIGS = [  # config.json as the probe edited it, and the field and value the one line names
    ({"hidden_size": 2**20}, "hidden_size 1048576"),
    ({"vocab_size": 2**31}, "vocab_size 2147483648"),
    ({"hidden_size": -128}, "hidden_size -128"),
    ({"num_hidden_layers": 100000, "layer_types": None}, "num_hidden_layers 100000"),
]


@pytest.mark.parametrize("config, named", IMPOSSIBLE_CONFIGS, ids=[n for _, n in IMPOSSIBLE_CONFIGS])
def test_a_verifier_config_that_cannot_be_built_is_refused_naming_the_field(verifier, tmp_path, config, named):
    model = _verifier_with(verifier, tmp_path / "verifier", **config)
    with pytest.raises(InputError, match=f"^{re.escape(str(model / 'config.json'))}: {named}[ ,]"):
        TransformersEngine(model, LAYERS, device="cpu")


@pytest.mark.slow
def test_extract_with_a_verifier_of_100000_layers_is_one_line_before_anything_is_allocated(verifier, prepared,
                                                                                           tmp_path):
    model = _verifier_with(verifier, tmp_path / "verifier", num_hidden_layers=100000, layer_types=None)
    # 4 GiB of address space: a tiny extraction needs under 3, building the model fails loudly
    proc = run_process("extract", "--model", model, "--data", prepared, "--store", tmp_path / "s",
                       "--target-layer-ids", 1, "--no-progress", why="a memory cap holds for a whole process",
                       check=False, timeout=120, preexec_fn=_address_space(4 << 30))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {model / 'config.json'}: num_hidden_layers 100000, but model.safetensors holds layers 0..5 only "
        "(fix: correct config.json to match the model's weights, or download the model folder again)"]
    assert not (tmp_path / "s").exists()


def test_a_verifier_too_big_for_this_machine_is_refused_from_its_config(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()  # no weights needed: the sizes alone say it cannot fit
    (folder / "config.json").write_text(json.dumps({"vocab_size": 2**20, "hidden_size": 2**16, "num_hidden_layers": 4,
                                                    "num_attention_heads": 64, "dtype": "bfloat16"}))
    with pytest.raises(InputError, match=r"config.json: a verifier of these sizes \(vocab_size 1048576, hidden_size "
                                         r"65536, num_hidden_layers 4.*\) needs at least 2\d\d.\d GB for its "
                                         r"weights in bfloat16, more than the \d+.\d GB of memory available"):
        check_verifier_config(folder)
    check_verifier_config(folder, host_memory=False)  # weights that go to a device are not held here


@pytest.mark.parametrize("config, why", [
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 130, "head_dim": None}, "hidden_size 130 is not a multiple of num_attention_heads 4 "
                                             r"\(and no head_dim is given\)"),
    ({"vocab_size": 512.0}, "vocab_size 512.0 is not a positive integer"),
])
def test_heads_that_do_not_divide_or_sizes_that_are_not_counts_are_refused(verifier, tmp_path, config, why):
    with pytest.raises(InputError, match="config.json: " + why):
        check_verifier_config(_verifier_with(verifier, tmp_path / "verifier", **config))


def test_the_decode_verifier_checks_its_config_too(verifier, tmp_path):
    model = _verifier_with(verifier, tmp_path / "verifier", hidden_size=-128)
    with pytest.raises(InputError, match=r"config.json: hidden_size -128 is not a positive integer"):
        Verifier(model, [1], "float32")


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


def test_extract_codec_is_recorded_a_store_keeps_its_own_and_the_card_repeats_it(verifier, prepared, tmp_path):
    from dspark.export.commands import extract_command
    from dspark.export.provenance import Provenance

    root = tmp_path / "lz4"
    args = ["extract", "--model", verifier, "--data", prepared, "--store", root, "--target-layer-ids", *LAYERS,
            "--no-progress"]
    run_cli(*args, "--codec", "lz4")
    store = ZarrStore(root)
    assert store.manifest.codec.name == "lz4" and store.manifest.checksum == "xxh3_64"
    assert len(store) == len(PreparedData(prepared)) and all(store.damaged(i) is None for i in store.sample_ids)
    proc = run_cli(*args, "--codec", "zstd", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: store {root} was created with codec lz4, not zstd: a store keeps the codec it was created with "
        "(fix: drop --codec to extend it, or pass a new --store for zstd)"]
    assert '"extracted": 0' in run_cli(*args).stdout  # without --codec: the store's own
    manifest = json.loads((root / "manifest.json").read_text())
    line, _ = extract_command(Provenance(train={"target_layer_ids": LAYERS}, manifest=manifest))
    assert " --codec lz4" in line.replace("\\\n    ", "")
    manifest["codec"] = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}
    assert "--codec" not in extract_command(Provenance(train={"target_layer_ids": LAYERS}, manifest=manifest))[0]


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
    return sum((p / "index.bin").stat().st_size // INDEX_RECORD.size
               for p in (root / "segments").iterdir() if (p / "index.bin").exists()) if (root / "segments").exists() else 0


def _extract_cmd(verifier, prepared, root):
    """The session store's extraction (conftest's `store`: --batch-tokens 1024), in chunks of 64 tokens so kills land
    between a sample's chunks."""
    return [sys.executable, "-m", "dspark.cli", "extract", "--model", str(verifier), "--data", str(prepared),
            "--store", str(root), "--target-layer-ids", *map(str, LAYERS), "--batch-tokens", "1024",
            "--chunk-tokens", "64", "--no-progress"]


@pytest.mark.slow
def test_kill_9_at_several_points_then_resume_is_byte_identical(verifier, prepared, store, tmp_path):
    """The uninterrupted reference is the session's store; each killed extract is a child process (kill -9 is the
    claim)."""
    reference = store
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
    out = run_cli(*_extract_cmd(verifier, prepared, root)[3:]).stdout
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
