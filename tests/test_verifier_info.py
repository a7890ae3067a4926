"""`VerifierInfo`: a verifier folder's config.json, read once and bounded, with the errors every command shows."""

import json
from pathlib import Path

import pytest

from dspark.core.errors import InputError
from dspark.verifier.info import JSON_LIMIT, VerifierInfo

LM = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 512,
      "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def folder_with(tmp_path, config) -> Path:
    folder = tmp_path / "verifier"
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


def test_a_plain_config_gives_the_language_model_facts(tmp_path):
    info = VerifierInfo.load(folder_with(tmp_path, LM))
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size, info.max_position_embeddings,
            info.model_type, info.dtype, info.weights_dtype) == (6, 128, 512, 4096, "llama", "bfloat16", "bfloat16")
    assert info.raw == info.config == LM and info.path == tmp_path / "verifier" / "config.json"


def test_a_multimodal_config_is_read_from_its_text_config(tmp_path):
    raw = {"model_type": "llava", "torch_dtype": "float16", "vision_config": {"hidden_size": 1024},
           "text_config": {k: v for k, v in LM.items() if k != "torch_dtype"}}
    info = VerifierInfo.load(folder_with(tmp_path, raw))
    assert (info.num_hidden_layers, info.hidden_size, info.model_type) == (6, 128, "llama")
    assert info.raw == raw  # the whole file: what the fingerprint hashes
    # transformers reads a text_config's dtype from the text_config alone; the weights' is the file's
    assert (info.dtype, info.weights_dtype) == (None, "float16")


def test_dtype_reads_the_new_key_first_and_drops_a_torch_prefix(tmp_path):
    info = VerifierInfo.load(folder_with(tmp_path, LM | {"dtype": "torch.float32"}))
    assert info.dtype == "float32"


def test_a_folder_without_config_json_says_which_flag_to_fix(tmp_path):
    with pytest.raises(InputError, match=f"^model folder {tmp_path} has no config.json "
                                         r"\(fix: pass a local Hugging Face model folder\)$"):
        VerifierInfo.load(tmp_path)
    with pytest.raises(InputError, match=f"^verifier folder {tmp_path} has no config.json \\(fix: pass --verifier"):
        VerifierInfo.load(tmp_path, noun="verifier folder", fix="pass --verifier-name-or-path the folder")


@pytest.mark.parametrize("text, message", [("{", "is unreadable"), ("[1, 2]", "is not a JSON object")])
def test_a_config_json_that_is_no_json_object_is_refused(tmp_path, text, message):
    with pytest.raises(InputError, match=f"config.json {message}"):
        VerifierInfo.load(folder_with(tmp_path, text))


def test_a_config_json_over_the_limit_is_not_read(tmp_path):
    folder = tmp_path / "verifier"
    folder.mkdir()
    with open(folder / "config.json", "wb") as f:
        f.truncate(JSON_LIMIT + 1)  # sparse: costs no disk
    with pytest.raises(InputError, match=f"is unreadable \\(is {JSON_LIMIT + 1} bytes, more than the {JSON_LIMIT}"):
        VerifierInfo.load(folder)


@pytest.mark.parametrize("value, message", [(None, "has no num_hidden_layers"),
                                            (-3, "num_hidden_layers -3 is not a positive integer"),
                                            (True, "num_hidden_layers true is not a positive integer")])
def test_a_missing_or_impossible_size_is_named_when_asked_for(tmp_path, value, message):
    info = VerifierInfo.load(folder_with(tmp_path, {**LM, "num_hidden_layers": value}))
    with pytest.raises(InputError, match=message):
        info.num_hidden_layers


def test_layer_ids_in_range_come_back_as_a_list(tmp_path):
    info = VerifierInfo.load(folder_with(tmp_path, LM))
    assert info.check_layer_ids((0, 3, 6)) == [0, 3, 6]  # 0: the embeddings; 6: the last layer


@pytest.mark.parametrize("ids, message", [
    ([1, 7], r"target layer id\(s\) \[7\] out of range for a verifier with 6 layers "
             r"\(fix: use ids in 0..6 \(0 = embeddings\)\)"),
    ([-1], r"target layer id\(s\) \[-1\] out of range"),
    ([], r"target layer id\(s\) \[\] out of range"),
    ([1, 3, 1], r"duplicate target layer ids \[1, 3, 1\] \(fix: list each layer once\)"),
])
def test_layer_ids_outside_the_verifier_or_repeated_are_refused(tmp_path, ids, message):
    with pytest.raises(InputError, match=message):
        VerifierInfo.load(folder_with(tmp_path, LM)).check_layer_ids(ids)
