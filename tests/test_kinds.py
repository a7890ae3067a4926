"""Drafter kinds (`dspark train --speculator-type`): each trains from the same store, loads in the decode loop,
decodes the verifier's own greedy output, and exports in the format vLLM serves it with."""

import json
import os

import pytest
import torch

from conftest import prompt_ids, run_cli, train_cfg, fit
from dspark.decode.drafter import Drafter
from dspark.decode.loop import autoregressive, speculative
from dspark.decode.verifier import Verifier
from dspark.errors import InputError
from dspark.evaluate import load_checkpoint


@pytest.fixture(scope="module")
def dflash_run(store, prepared, verifier, tmp_path_factory):
    c = train_cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "dflash", speculator_type="dflash",
                  epochs=1, checkpoint_freq=1.0)
    return c, fit(c)


def test_a_dflash_run_trains_speculators_dflash_model_in_dflash_layout(dflash_run):
    c, records = dflash_run
    assert c.sample_from_anchor is False  # the kind's own layout: what vLLM's `method: dflash` serves
    train = [r["metrics"]["loss"] for r in records if r["split"] == "train"]
    assert len(train) >= 4 and train[-1] < train[0]
    saved = json.loads((open(os.path.join(c.save_path, "latest", "config.json"))).read())
    assert saved["speculators_model_type"] == "dflash" and saved["sample_from_anchor"] is False
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu"))
    assert type(model).__name__ == "DFlashDraftModel"
    assert not any("markov" in n or "confidence" in n for n, _ in model.named_parameters())


def test_greedy_decoding_with_a_dflash_drafter_is_the_verifiers_own_output(dflash_run, verifier, prepared):
    c, _ = dflash_run
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu")).float()
    drafter, v = Drafter(model), Verifier(verifier, model.target_layer_ids)
    assert drafter.confidence is None and drafter.markov is None and drafter.num_speculative_tokens == 7
    eos = {v.model.config.eos_token_id}
    accepted = 0
    for prompt in prompt_ids(prepared, 4):
        spec = speculative(v, drafter, prompt, 32, eos=eos)
        assert spec.tokens == autoregressive(v, prompt, 32, eos=eos).tokens
        accepted += sum(spec.accepted)
    assert accepted > 0


def test_a_dflash_export_names_its_kind_and_is_served_as_dflash(dflash_run, tmp_path):
    from dspark.serve_draft import ServeDraftConfig, choose

    c, _ = dflash_run
    out = tmp_path / "export"
    run_cli("export", os.path.join(c.save_path, "latest"), "--output", out,
            "--verifier-name", "Org/Tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    cfg = ServeDraftConfig(verifier="v", drafter=str(out))
    for gpu in (False, True):
        assert choose(cfg, gpu)[:2] == ("dflash", 7)
        assert choose(cfg, gpu)[2] is None  # no warning: the layout V1's DFlash proposer serves
    with pytest.raises(InputError, match="is a DFlash drafter"):
        choose(ServeDraftConfig(verifier="v", drafter=str(out), method="dspark"), True)
    card = (out / "README.md").read_text()
    assert "--markov-rank" not in card and "--speculator-type dflash" in card
    assert "# DFlash drafter for Org/Tiny" in card and "| Markov head |" not in card and "VLLM_USE_V2_MODEL_RUNNER" not in card
    assert '"method": "dflash"' in card


def test_a_checkpoint_of_a_kind_dspark_does_not_read_is_one_line(dflash_run, tmp_path):
    import shutil

    c, _ = dflash_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.realpath(os.path.join(c.save_path, "latest")), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "speculators_model_type": "medusa"}))
    with pytest.raises(InputError, match=r"holds a 'medusa' drafter.*dspark reads the kinds"):
        load_checkpoint(ckpt, None, torch.device("cpu"))


def test_teacher_forced_eval_scores_a_dflash_drafter(dflash_run, store, tmp_path):
    c, _ = dflash_run
    run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--store", store, "--output", tmp_path)
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["blocks"] > 0 and 1 <= result["tau_greedy"] <= 8


def test_compare_puts_every_drafter_and_prompt_lookup_in_one_table(dflash_run, reference_run, chat_file, tmp_path):
    c, _ = dflash_run
    ref, _ = reference_run
    out = tmp_path / "cmp"
    proc = run_cli("compare", "--drafter", f"dspark={ref.save_path}/latest", "--drafter", f"dflash={c.save_path}/latest",
                   "--prompts", f"chat={chat_file}", "--max-prompts", "3", "--max-new-tokens", "24",
                   "--prompt-lookup-min", "1", "--output", out, "--no-progress")
    result = json.loads((out / "compare.json").read_text())
    assert [d["name"] for d in result["drafters"]] == ["dspark", "dflash", "ngram"]
    assert [d["kind"] for d in result["drafters"]] == ["dspark", "dflash", "ngram"]
    assert result["drafters"][0]["train_steps"] > 0 and result["drafters"][0]["params"] > 0
    assert result["drafters"][2]["params"] == 0 and result["drafters"][2]["train_steps"] is None
    (chat,) = result["datasets"]
    for name, s in chat["drafters"].items():
        assert s["outputs_equal_verifier_only"] == chat["prompts"] == 3, name  # greedy: lossless, every kind
        assert s["speedup"] > 0 and len(s["positions"]) == {"dspark": 8, "dflash": 7, "ngram": 4}[name]
    assert chat["drafters"]["ngram"]["drafted_steps"] <= chat["drafters"]["ngram"]["drafts"]
    table = (out / "compare.md").read_text()
    assert "| dspark |" in table and "| dflash |" in table and "| ngram |" in table and "training steps" in table
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG" and "| ngram |" in proc.stdout
