"""Drafter kinds (`dspark train --speculator-type`): each trains from the same store, loads in the decode loop,
decodes the verifier's own greedy output, and exports in the format vLLM serves it with."""

import json
import os

import pytest
import torch

from conftest import prompt_ids, run_cli, train_cfg, fit
from dspark.decode.config import SamplingConfig
from dspark.decode.drafter import Drafter, drafter_for
from dspark.decode.loop import autoregressive, speculative
from dspark.decode.verifier import Verifier
from dspark.core.errors import InputError
from dspark.train.model import load_checkpoint
from dspark.kinds import DSPARK_LAYOUT

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def dflash_run(store, prepared, verifier, tmp_path_factory):
    # two of the store's three layers: a drafter reads the layers it names out of a wider store
    c = train_cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "dflash", speculator_type="dflash",
                  epochs=1, checkpoint_freq=1.0, target_layer_ids=[1, 5])
    return c, fit(c)


@pytest.fixture(scope="module")
def eagle3_run(store, prepared, verifier, tmp_path_factory):
    c = train_cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "eagle3", speculator_type="eagle3",
                  epochs=1, checkpoint_freq=1.0, draft_vocab_size=256)
    return c, fit(c)


def decodes_like_the_verifier(export_dir, verifier, prepared) -> None:
    """An exported folder (it names the verifier portably) loads in the decode loop and decodes losslessly."""
    model = load_checkpoint(export_dir, str(verifier), torch.device("cpu")).float()
    drafter, v = drafter_for(model, DSPARK_LAYOUT), Verifier(verifier, model.target_layer_ids, "float32")
    prompt = prompt_ids(prepared, 1)[0]
    assert speculative(v, drafter, prompt, 16, sampling=GREEDY).tokens == \
        autoregressive(v, prompt, 16, sampling=GREEDY).tokens


def test_a_dflash_run_trains_speculators_dflash_model_in_dflash_layout(dflash_run):
    c, records = dflash_run
    assert c.sample_from_anchor is False  # the kind's own layout: what vLLM's `method: dflash` serves
    train = [r["metrics"]["loss"] for r in records if r["split"] == "train"]
    assert len(train) >= 4 and train[-1] < train[0]
    saved = json.loads((open(os.path.join(c.save_path, "latest", "config.json"))).read())
    assert saved["speculators_model_type"] == "dflash" and saved["sample_from_anchor"] is False
    assert saved["sliding_window_non_causal"] is True  # vLLM then serves its blocks bidirectional, as trained
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu"))
    assert type(model).__name__ == "DFlashDraftModel"
    assert not any("markov" in n or "confidence" in n for n, _ in model.named_parameters())
    assert model.target_layer_ids == [1, 5] and model.fc.in_features == 2 * 128


def test_an_eagle3_run_trains_speculators_eagle3_model(eagle3_run):
    c, records = eagle3_run
    assert c.loss_fn == "kl_div"  # speculators' EAGLE-3 default
    train = [r["metrics"]["loss"] for r in records if r["split"] == "train"]
    assert len(train) >= 4 and train[-1] < train[0]
    saved = json.loads((open(os.path.join(c.save_path, "latest", "config.json"))).read())
    assert saved["speculators_model_type"] == "eagle3" and saved["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert saved["draft_vocab_size"] == 256
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == c.ttt_steps == 3


def test_eagle3_reads_exactly_three_layers(store, prepared, verifier, tmp_path):
    with pytest.raises(InputError, match="eagle3 reads 3 target layers, not 2"):
        train_cfg(store, prepared, verifier, tmp_path, speculator_type="eagle3", target_layer_ids=[1, 5]).validate()


def test_an_eagle3_proposal_is_the_training_forward_at_that_anchor(eagle3_run, verifier, prepared):
    """Each training-time-test step's logits at an anchor are the proposal's there (step 1 teacher-forced)."""
    from dspark.train.model import loss_kwargs, model_inputs

    c, _ = eagle3_run
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu")).float()
    drafter = drafter_for(model, DSPARK_LAYOUT)
    ids = torch.tensor(prompt_ids(prepared, 3)[2] + [5, 9, 11, 7])
    v = Verifier(verifier, model.target_layer_ids, "float32")
    v.reset()
    _, states = v.forward(ids)
    T = len(ids)
    batch = {"hidden_states": states[None], "verifier_last_hidden_states": torch.zeros(1, T, 128),
             "input_ids": ids[None], "loss_mask": torch.ones(1, T, dtype=torch.long),
             "document_ids": torch.zeros(1, T, dtype=torch.long), "position_ids": torch.arange(T)[None]}
    steps = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: steps.append(out[0].float()))
    with torch.no_grad():
        model(**model_inputs(c, batch), **loss_kwargs(model, c, torch.device("cpu")))
    hook.remove()
    assert len(steps) == 3
    for p in (3, T // 2, T - 3):  # row p-1 of the shifted batch pairs token p with the state before it
        ctx = drafter.context(ids[:p].tolist(), states[:p])
        hidden = drafter._layers(ctx, ids[1:p + 1], ctx.fused, 1)
        logits, feed = drafter._head(hidden[-1:])
        torch.testing.assert_close(logits[0], steps[0][p - 1], atol=1e-4, rtol=1e-4)  # float32, any x86 CPU
        logits, _ = drafter._head(drafter._layers(ctx, ids[p + 1:p + 2], feed, p + 1))
        torch.testing.assert_close(logits[0], steps[1][p - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle3_decodes_exactly_with_a_cached_context_reused_across_decodes(eagle3_run, verifier, prepared,
                                                                              temperature):
    from dspark.decode.loop import prefill

    c, _ = eagle3_run
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu")).float()
    drafter, v = drafter_for(model, DSPARK_LAYOUT), Verifier(verifier, model.target_layer_ids, "float32")
    eos, sampling = {v.model.config.eos_token_id}, SamplingConfig(temperature=temperature)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    for prompt in prompt_ids(prepared, 4):
        alone = speculative(v, drafter, prompt, 32, sampling=sampling, eos=eos, gen=gen())
        pre = prefill(v, drafter, prompt)
        for _ in range(2):  # a prompt's context rewound and decoded again: the same steps
            again = speculative(v, drafter, prompt, 32, sampling=sampling, eos=eos, gen=gen(), prefilled=pre)
            assert (again.tokens, again.accepted) == (alone.tokens, alone.accepted)
        if temperature == 0:
            assert alone.tokens == autoregressive(v, prompt, 32, sampling=GREEDY, eos=eos).tokens


def test_greedy_decoding_with_a_dflash_drafter_is_the_verifiers_own_output(dflash_run, verifier, prepared):
    c, _ = dflash_run
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu")).float()
    drafter, v = Drafter(model, DSPARK_LAYOUT), Verifier(verifier, model.target_layer_ids, "float32")
    assert drafter.confidence is None and drafter.markov is None and drafter.num_speculative_tokens == 7
    eos = {v.model.config.eos_token_id}
    accepted = 0
    for prompt in prompt_ids(prepared, 4):
        spec = speculative(v, drafter, prompt, 32, sampling=GREEDY, eos=eos)
        assert spec.tokens == autoregressive(v, prompt, 32, sampling=GREEDY, eos=eos).tokens
        accepted += sum(spec.accepted)
    assert accepted > 0


def test_a_dflash_export_names_its_kind_and_is_served_as_dflash(dflash_run, verifier, prepared, tmp_path):
    from dspark.serving.serve_draft import ServeDraftConfig, choose

    c, _ = dflash_run
    out = tmp_path / "export"
    run_cli("export", os.path.join(c.save_path, "latest"), "--output", out,
            "--verifier-name", "Org/Tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    decodes_like_the_verifier(out, verifier, prepared)
    cfg = ServeDraftConfig(verifier="v", drafter=str(out))
    for gpu, runner in ((False, "v1"), (True, "v2")):
        assert choose(cfg, gpu) == ("dflash", 7, runner)  # the layout DFlash's proposer serves on either runner
    with pytest.raises(InputError, match="does not serve .*, a dflash drafter"):
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


def test_compare_puts_every_drafter_and_prompt_lookup_in_one_table(dflash_run, eagle3_run, reference_run, chat_file,
                                                                   tmp_path):
    import shutil

    # copies: compare records itself beside each checkpoint it reads, and the fixtures' runs are shared
    runs = {name: tmp_path / name for name in ("dspark", "dflash", "eagle3")}
    for (name, ckpt), (c, _) in zip(runs.items(), (reference_run, dflash_run, eagle3_run)):
        shutil.copytree(os.path.realpath(os.path.join(c.save_path, "latest")), ckpt)
    out = tmp_path / "cmp"
    proc = run_cli("compare", *(a for name, ckpt in runs.items() for a in ("--drafter", f"{name}={ckpt}")),
                   "--prompts", f"chat={chat_file}", "--max-prompts", "3", "--max-new-tokens", "24",
                   "--prompt-lookup-min", "1", "--output", out, "--no-progress",
                   "--calibration-prompts", f"train={reference_run[0].data_path}", "--calibration-max-prompts", "2")
    result = json.loads((out / "compare.json").read_text())
    assert [d["name"] for d in result["drafters"]] == ["dspark", "dflash", "eagle3", "ngram"]
    assert [d["kind"] for d in result["drafters"]] == ["dspark", "dflash", "eagle3", "ngram"]
    assert result["captured_layers"] == [1, 3, 5]  # the union: dflash reads 1 and 5 of them
    assert result["drafters"][0]["train_steps"] > 0 and result["drafters"][0]["params"] > 0
    assert result["drafters"][3]["params"] == 0 and result["drafters"][3]["train_steps"] is None
    (chat,) = result["datasets"]
    for name, s in chat["drafters"].items():
        assert s["outputs_equal_verifier_only"] == chat["prompts"] == 3, name  # greedy: lossless, every kind
        assert len(s["per_request"]) == 3 and s["mean_acceptance_length_se"] >= 0, name
        assert s["speedup"] > 0 and len(s["positions"]) == {"dspark": 8, "dflash": 7, "eagle3": 3, "ngram": 4}[name]
    assert chat["drafters"]["ngram"]["drafted_steps"] <= chat["drafters"]["ngram"]["drafts"]
    # each drafter also verifies its best fixed k (chosen on the calibration prompts) and, with a confidence
    # head, what its confidences pay for; every one still the verifier's own output
    cal, prof = result["calibration"], result["cost_profile"]
    assert cal["set"]["prompts"] == 2 and set(cal["k"]) == set(chat["drafters"])
    assert len(prof["draft_ms"]["eagle3"]) == 3 and len(prof["draft_ms"]["dspark"]) == 1  # one after the other
    assert all(len(row) == 9 for row in prof["check_ms"])  # DSpark's anchor and 8 drafts, the most any verifies
    for name, s in chat["drafters"].items():
        want = ["fixed N", "best fixed k", "cost-driven"] if name == "dspark" else ["fixed N", "best fixed k"]
        assert list(s["verification"]) == want, name
        assert all(v["outputs_equal_verifier_only"] == 3 for v in s["verification"].values()), name
        assert s["verification"]["best fixed k"]["verified_per_step"] <= cal["k"][name], name
    table = (out / "compare.md").read_text()
    assert "| dspark |" in table and "| dflash |" in table and "| ngram |" in table and "training steps" in table
    se = chat["drafters"]["dspark"]["mean_acceptance_length_se"]
    assert f"| {chat['drafters']['dspark']['mean_acceptance_length']:.2f} ± {se:.2f} |" in table
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG" and "| ngram |" in proc.stdout
    # ...and in each checkpoint's eval/, naming its row: the drafter's model card carries the table
    beside = json.loads((runs["dflash"] / "eval" / "compare.json").read_text())
    assert (beside["row"], beside["checkpoint"]) == ("dflash", str(runs["dflash"].resolve()))
    assert beside["datasets"] == result["datasets"]
    run_cli("export", runs["dflash"], "--output", tmp_path / "export", "--verifier-name", "Org/Tiny")
    card = (tmp_path / "export" / "README.md").read_text()
    assert "### Side by side with other drafters" in card and "This drafter is the row `dflash`." in card
    assert "| eagle3 | eagle3 |" in card and (tmp_path / "export" / "compare.png").is_file()


def test_an_eagle3_export_is_served_as_eagle3_and_refuses_teacher_forced_eval(eagle3_run, store, verifier, prepared,
                                                                               tmp_path):
    from dspark.serving.serve_draft import ServeDraftConfig, choose

    c, _ = eagle3_run
    out = tmp_path / "export"
    run_cli("export", os.path.join(c.save_path, "latest"), "--output", out, "--verifier-name", "Org/Tiny")
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    decodes_like_the_verifier(out, verifier, prepared)
    for gpu, runner in ((False, "v1"), (True, "v2")):
        assert choose(ServeDraftConfig(verifier="v", drafter=str(out)), gpu) == ("eagle3", 3, runner)
    with pytest.raises(InputError, match="does not serve .*, a eagle3 drafter"):
        choose(ServeDraftConfig(verifier="v", drafter=str(out), method="dflash"), False)
    card = (out / "README.md").read_text()
    assert "# EAGLE-3 drafter for Org/Tiny" in card and '"method": "eagle3"' in card
    assert "| Target layer ids | 1, 3, 5 (of the verifier's 6 layers) |" in card
    assert "| Block size |" not in card and "--block-size" not in card and "--ttt-steps 3" in card
    proc = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--store", store, check=False)
    assert proc.returncode != 0 and "is an EAGLE-3 drafter" in proc.stderr and "--decode" in proc.stderr


@pytest.mark.parametrize("head", [{"markov_head_type": "gated"}, {"markov_head_type": "rnn"},
                                  {"markov_rank": 0, "confidence_head_with_markov": False}])
def test_export_refuses_a_markov_head_vllm_cannot_load_in_one_line(head, store, prepared, verifier, tmp_path):
    """vLLM's DSpark model loads a vanilla head of rank > 0 only: a gated or rnn head would load as a vanilla one,
    rank 0 as an empty one."""
    c = train_cfg(store, prepared, verifier, tmp_path / "run", epochs=1, max_steps=1, **head)
    fit(c)
    proc = run_cli("export", os.path.join(c.save_path, "latest"), "--output", tmp_path / "export",
                   "--verifier-name", "Org/Tiny", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "cannot load: it loads only a vanilla head (markov_w1, markov_w2) of markov_rank > 0" in proc.stderr
    assert "--markov-head-type vanilla and --markov-rank > 0" in proc.stderr
    assert not (tmp_path / "export").exists()
