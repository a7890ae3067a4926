"""A verifier given as a hub id is read from the Hugging Face cache, offline, by every command that takes one."""

import json
import os

import pytest

from conftest import LAYERS, hf_cache_model, run_process
from dspark.verifier.resolved import Verifier
from dspark.connector.manifest import default_store, manifest_for_model
from dspark.core.errors import InputError
from dspark.verifier.hub import local_model, model_name
from dspark.data.prepare import PreparedData


def test_local_model_is_the_folder_or_the_cached_snapshot(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    assert local_model(folder) == folder
    snapshot = hf_cache_model(tmp_path / "hf", "Org/Tiny", config={"num_hidden_layers": 2})
    assert local_model("Org/Tiny", tmp_path / "hf" / "hub") == snapshot
    assert local_model("Org/Tiny", tmp_path / "hf" / "hub", revision="main") == snapshot
    with pytest.raises(InputError, match=r"neither a local folder nor revision v2 of a model in the Hugging Face "):
        local_model("Org/Tiny", tmp_path / "hf" / "hub", revision="v2")
    for missing in ("Org/Other", "no/such/folder", str(tmp_path / "gone")):
        with pytest.raises(InputError, match=f"{missing} is neither a local folder nor a model in the Hugging Face "
                                             f"cache at {tmp_path / 'hf' / 'hub'}"):
            local_model(missing, tmp_path / "hf" / "hub")


def test_model_name_of_a_snapshot_is_the_repos(tmp_path):
    snapshot = hf_cache_model(tmp_path / "hf", "moonshotai/Kimi-K3", config={})
    assert model_name(snapshot) == "Kimi-K3"
    assert model_name(tmp_path / "models" / "tiny") == "tiny"
    assert default_store(snapshot, [1, 3], "abcdef0123456789") == "cache/stores/Kimi-K3-L1-3-abcdef012345"


HF_HOME_AT_START = "HF_HOME is read where a process starts (huggingface_hub's constants), as the user's shell sets it"


@pytest.fixture
def cached(verifier, tmp_path, monkeypatch):
    """The toy verifier in a Hugging Face cache as `Org/tiny`, HF_HOME pointing there (for the CLI's children)."""
    hf_cache_model(tmp_path / "hf", "Org/tiny", source=verifier)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return "Org/tiny"


@pytest.mark.slow
def test_prepare_with_a_hub_id_equals_prepare_with_its_folder(cached, verifier, chat_file, prepared, tmp_path):
    run_process("prepare", "--model", cached, "--data", chat_file, "--output", tmp_path / "p", "--seq-length", "256",
                "--minimum-valid-tokens", "8", why=HF_HOME_AT_START)
    assert PreparedData(tmp_path / "p").fingerprint == PreparedData(prepared).fingerprint
    proc = run_process("prepare", "--model", "Org/absent", "--data", chat_file, "--output", tmp_path / "q",
                       why=HF_HOME_AT_START, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: Org/absent is neither a local folder nor a model in the Hugging Face cache")


@pytest.mark.slow
def test_train_with_a_hub_id_meets_the_store_its_folder_wrote(cached, verifier, prepared, store, tmp_path):
    """Same identity (config, tokenizer, weights) and the same default store name as the folder gives."""
    snapshot = local_model(cached, tmp_path / "hf" / "hub")
    identity = manifest_for_model(Verifier.resolve(verifier), LAYERS, "f", encoding="raw").model_dump()
    assert manifest_for_model(Verifier.resolve(snapshot), LAYERS, "f", encoding="raw").model_dump() == identity
    assert default_store(snapshot, LAYERS, "f" * 12) == default_store(verifier, LAYERS, "f" * 12)
    out = run_process("train", "--verifier-name-or-path", cached, "--store", store, "--data-path", prepared,
                      "--save-path", tmp_path / "run", "--target-layer-ids", *LAYERS, "--max-steps", "1",
                      "--total-seq-len", "512", "--max-anchors", "16", "--markov-rank", "8", "--no-progress",
                      why=HF_HOME_AT_START, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads(out.stdout)["steps"] == 1
