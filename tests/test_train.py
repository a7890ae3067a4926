import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import LAYERS, fit, run_cli, train_cfg as cfg
from dspark.errors import InputError, StoreError, StoreMismatch
from dspark.train.loop import Trainer
from dspark.train.metrics import MetricLog


@pytest.fixture(scope="module")
def reference_run(store, prepared, verifier, tmp_path_factory):
    c = cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "ref")
    return c, fit(c)


def test_loss_falls_and_tau_rises(reference_run):
    _, records = reference_run
    val = [r["metrics"] for r in records if r["split"] == "val"]
    assert len(val) == 4  # two checkpoints per epoch, two epochs
    train = [r["metrics"] for r in records if r["split"] == "train"]
    assert val[-1]["loss"] < 0.8 * train[0]["loss"]  # step 1 measures the untrained drafter
    assert val[-1]["loss"] < val[0]["loss"] and val[-1]["accept_len"] > val[0]["accept_len"]
    assert sum(m["loss"] for m in train[-3:]) < sum(m["loss"] for m in train[:3])
    assert {"ce_loss", "tv_loss", "accept_rate", "accept_len", "position_7_acc", "confidence_abs_error",
            "grad_norm", "lr"} <= set(train[0])


def test_checkpoints_and_run_record(reference_run):
    c, records = reference_run
    run = __import__("pathlib").Path(c.save_path)
    latest = (run / "latest").resolve()
    assert latest.name == f"step-{records[-1]['step']:06d}" and (run / "best").exists()
    assert {"config.json", "model.safetensors", "trainer_state.pt"} <= {p.name for p in latest.iterdir()}
    assert json.loads((latest / "config.json").read_text())["speculators_model_type"] == "dspark"
    rec = json.loads((run / "config.json").read_text())
    assert rec["train"]["lr"] == 3e-3 and rec["seed"] == 0 and len(rec["store_fingerprint"]) == 64
    assert {"torch", "speculators", "dspark"} <= set(rec["versions"])


def test_resume_equals_uninterrupted_bitwise(reference_run, tmp_path):
    c, records = reference_run
    interrupted = replace(c, save_path=str(tmp_path / "r"), max_steps=len(records) // 2 + 1)
    partial = fit(interrupted)
    assert partial[-1]["step"] == interrupted.max_steps  # logged past its last checkpoint
    resumed = fit(replace(interrupted, max_steps=None))
    assert [r["metrics"] for r in resumed] == [r["metrics"] for r in records]


def test_resume_with_other_config_is_refused_unless_forced(reference_run, tmp_path):
    c, _ = reference_run
    run = tmp_path / "r"
    fit(replace(c, save_path=str(run), max_steps=2))
    with pytest.raises(InputError, match=r"differs in: lr, markov_rank"):
        Trainer(replace(c, save_path=str(run), lr=1e-2, markov_rank=8), progress=False)
    Trainer(replace(c, save_path=str(run), lr=1e-2), force=True, progress=False)


@pytest.mark.parametrize("change, match", [
    (dict(target_layer_ids=[2, 4]), "layer ids: store \\[1, 3, 5\\], --target-layer-ids \\[2, 4\\]"),
    (dict(total_seq_len=8), "shorter than two blocks"),
    (dict(train_data_ratio=0.999), "validation split is empty"),
])
def test_bad_training_inputs(reference_run, tmp_path, change, match):
    c, _ = reference_run
    with pytest.raises((InputError, StoreMismatch), match=match):
        Trainer(replace(c, save_path=str(tmp_path / "r"), **change), progress=False)


def test_store_from_another_tokenizer_is_refused(reference_run, verifier, tmp_path):
    c, _ = reference_run
    other = tmp_path / "other"
    shutil.copytree(verifier, other)
    tc = json.loads((other / "tokenizer_config.json").read_text())
    tc["model_max_length"] = 123
    (other / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(StoreMismatch, match="tokenizer hash"):
        Trainer(replace(c, save_path=str(tmp_path / "r"), verifier_name_or_path=str(other)), progress=False)


def test_reduced_draft_vocab_trains(reference_run, tmp_path):
    c, _ = reference_run
    records = fit(replace(c, save_path=str(tmp_path / "r"), draft_vocab_size=128, epochs=1))
    assert all(torch.isfinite(torch.tensor(r["metrics"]["loss"])) for r in records)
    ckpt = (tmp_path / "r" / "latest").resolve()
    assert json.loads((ckpt / "config.json").read_text())["draft_vocab_size"] == 128
    weights = load_file(ckpt / "model.safetensors")
    assert weights["d2t"].shape == (128,) and weights["lm_head.weight"].shape[0] == 128


def test_export_reloads_identically_without_local_paths(reference_run, tmp_path):
    from speculators.models.dspark import DSparkDraftModel

    c, _ = reference_run
    ckpt = os.path.join(c.save_path, "latest")
    out = tmp_path / "export"
    proc = run_cli("export", ckpt, "--output", out, "--verifier-name", "Org/Tiny")
    assert '"method": "dspark"' in proc.stdout and "vllm serve Org/Tiny" in (out / "README.md").read_text()
    text = (out / "config.json").read_text()
    assert str(c.verifier_name_or_path) not in text and "/tmp" not in text
    assert json.loads(text)["speculators_config"]["verifier"]["name_or_path"] == "Org/Tiny"
    from dspark.evaluate import load_checkpoint

    model = load_checkpoint(out, c.verifier_name_or_path, torch.device("cpu"))
    assert isinstance(model, DSparkDraftModel)
    saved = load_file(out / "model.safetensors")
    state = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k


def test_replay_reproduces_and_catches_tampering(reference_run, store, tmp_path):
    c, records = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    ok = run_cli("replay", run, "--no-progress")
    assert "REPRODUCED" in ok.stdout and f'"records": {len(records)}' in ok.stdout
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    rec["metrics"]["accept_rate"] += 1e-12
    lines[3] = json.dumps(rec)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    bad = run_cli("replay", run, "--no-progress", check=False)
    assert bad.returncode == 1 and "DIVERGED: record 3" in bad.stderr and "accept_rate" in bad.stderr
    # a changed store is refused before any training
    changed = tmp_path / "store"
    shutil.copytree(store, changed)
    seg = next((changed / "segments").iterdir())
    data = (seg / "index.bin").read_bytes()
    (seg / "index.bin").write_bytes(data[:-32])  # one sample fewer
    refused = run_cli("replay", run, "--store", changed, "--no-progress", check=False)
    assert refused.returncode == 2 and "not the one run" in refused.stderr


def test_eval_writes_json_markdown_and_plot(reference_run, store, tmp_path):
    c, _ = reference_run
    proc = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--store", store,
                   "--output", tmp_path / "ev")
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert len(result["positions"]) == 8 and result["by_context"]
    assert 1.0 <= result["tau_greedy"] <= 9 and 1.0 <= result["tau_analytic"] <= 9
    for p in result["positions"]:
        # float32 results: a few ulps of slack (an AVX2-only CPU rounds differently from AVX512)
        assert 0 <= p["analytic_reach"] <= p["analytic_accept"] + 1e-6 <= 1 + 1e-6
    assert (tmp_path / "ev" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| pos |" in proc.stdout
    missing = run_cli("eval", "--checkpoint", tmp_path / "nope", "--store", store, check=False)
    assert missing.returncode == 2 and "is not a checkpoint" in missing.stderr


@pytest.mark.slow
def test_two_process_gloo_run_trains(store, prepared, verifier, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
         "-m", "dspark.cli", "train", "--store", store, "--data-path", prepared, "--verifier-name-or-path", verifier,
         "--save-path", tmp_path / "ddp", "--target-layer-ids", *map(str, LAYERS), "--max-anchors", "32",
         "--markov-rank", "16", "--total-seq-len", "512", "--epochs", "1", "--log-freq", "2", "--lr", "3e-3",
         "--no-progress", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = MetricLog(tmp_path / "ddp" / "metrics.jsonl", tensorboard=False).read()
    rec = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert rec["world_size"] == 2 and records and records[-1]["split"] == "val"
    assert (tmp_path / "ddp" / "latest" / "model.safetensors").exists()


def test_partial_store_is_refused_with_the_fix(reference_run, store, tmp_path):
    c, _ = reference_run
    partial = tmp_path / "store"
    shutil.copytree(store, partial)
    seg = next((partial / "segments").iterdir())
    (seg / "index.bin").write_bytes((seg / "index.bin").read_bytes()[:-64])  # two samples never finished
    with pytest.raises(StoreError, match="rerun the same `dspark extract`"):
        Trainer(replace(c, store=str(partial), save_path=str(tmp_path / "r")), progress=False)


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_matches_the_uninterrupted_run(store, prepared, verifier, tmp_path):
    import signal
    import time

    def cmd(save):
        return [sys.executable, "-m", "dspark.cli", "train", "--store", store, "--data-path", prepared,
                "--verifier-name-or-path", verifier, "--save-path", save, "--target-layer-ids", *map(str, LAYERS),
                "--max-anchors", "32", "--markov-rank", "16", "--total-seq-len", "512", "--epochs", "2",
                "--checkpoint-freq", "0.25", "--log-freq", "1", "--lr", "3e-3", "--no-progress", "--device", "cpu"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd(tmp_path / "ref"), check=True, capture_output=True, env=env)
    reference = MetricLog(tmp_path / "ref" / "metrics.jsonl", tensorboard=False).read()
    run = tmp_path / "killed"
    proc = subprocess.Popen(cmd(run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def logged_past_checkpoint() -> bool:
        latest = run / "latest"
        if not latest.exists():
            return False
        ckpt_step = int(latest.resolve().name.split("-")[1])
        return any(r["step"] > ckpt_step + 1 for r in MetricLog(run / "metrics.jsonl", tensorboard=False).read())

    deadline = time.time() + 300
    while not logged_past_checkpoint() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(MetricLog(run / "metrics.jsonl", tensorboard=False).read()) < len(reference)
    resumed = subprocess.run(cmd(run), capture_output=True, text=True, env=env)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr
    assert [r["metrics"] for r in MetricLog(run / "metrics.jsonl", tensorboard=False).read()] == \
           [r["metrics"] for r in reference]
