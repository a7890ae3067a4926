"""`--no-sample-from-anchor`: DFlash's block layout (slot 0 = the anchor, untrained; slot k predicts p+k).

vLLM's V1 `method: dflash` proposer serves this layout; DSpark's default (slot k predicts p+k+1) is
served by `method: dspark`. The option changes what is trained, so a resume must not switch it.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import fit, run_cli, train_cfg as cfg
from dspark.verifier.resolved import Verifier
from dspark.core.errors import InputError
from dspark.train.config import RESULT_NEUTRAL, TrainConfig
from dspark.train.loop import Trainer


@pytest.fixture(scope="module")
def no_anchor_run(store, prepared, verifier, tmp_path_factory):
    c = cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "noanchor", sample_from_anchor=False,
            epochs=1, max_steps=4, checkpoint_freq=1.0)
    return c, fit(c)


def test_a_no_anchor_run_trains_and_records_dflash_layout(no_anchor_run):
    c, records = no_anchor_run
    run = Path(c.save_path)
    saved = json.loads(((run / "latest").resolve() / "config.json").read_text())
    assert saved["sample_from_anchor"] is False and saved["block_size"] == 8
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8 - 1
    assert json.loads((run / "config.json").read_text())["train"]["sample_from_anchor"] is False
    train = [r["metrics"] for r in records if r["split"] == "train"]
    assert train and all(0 < m["loss"] < float("inf") for m in train)


def test_the_default_keeps_dspark_layout(store, prepared, verifier, tmp_path):
    from dspark.data.prepare import PreparedData
    from dspark.train.model import build_model

    import torch

    c = cfg(store, prepared, verifier, tmp_path / "r")
    assert c.sample_from_anchor is True
    for anchor, drafts in ((True, 8), (False, 7)):
        model = build_model(replace(c, sample_from_anchor=anchor), PreparedData(prepared), torch.device("cpu"),
                            Verifier.resolve(c.verifier_name_or_path))
        assert model.config.sample_from_anchor is anchor
        assert model.config.speculators_config.proposal_methods[0].speculative_tokens == drafts


def test_resuming_with_the_other_layout_is_refused(no_anchor_run):
    c, _ = no_anchor_run
    assert "sample_from_anchor" not in RESULT_NEUTRAL
    with pytest.raises(InputError, match=r"differs in: sample_from_anchor"):
        Trainer(replace(c, sample_from_anchor=True), progress=False)


def test_a_record_from_before_the_option_reads_as_the_dspark_layout(no_anchor_run):
    c, _ = no_anchor_run
    old = {k: v for k, v in c.to_dict().items() if k != "sample_from_anchor"}
    assert TrainConfig.from_dict(old).sample_from_anchor is True


def test_the_flag_reaches_the_resolved_config(store, prepared, verifier, tmp_path):
    args = ["train", "--store", store, "--data-path", prepared, "--verifier-name-or-path", verifier,
            "--save-path", tmp_path / "r", "--target-layer-ids", "1", "3", "5", "--print-config"]
    assert json.loads(run_cli(*args).stdout)["sample_from_anchor"] is True
    assert json.loads(run_cli(*args, "--no-sample-from-anchor").stdout)["sample_from_anchor"] is False


def test_a_block_of_only_the_anchor_is_refused(no_anchor_run):
    c, _ = no_anchor_run
    with pytest.raises(InputError, match="drafts no token"):
        replace(c, block_size=1, total_seq_len=512).validate()
    replace(c, block_size=1, sample_from_anchor=True).validate()
