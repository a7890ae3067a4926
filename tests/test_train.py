import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import LAYERS, fit, run_cli, train_cfg as cfg, wait_for
from dspark.core.errors import CheckpointError, InputError, StoreError, StoreMismatch
from dspark.train.checkpoint import RunDir, load_trainer_state, rng_state, set_rng_state
from dspark.train.loop import Trainer
from dspark.train.metrics import MetricLog


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
    assert partial[-1]["step"] == interrupted.max_steps  # stopped between two regular checkpoints...
    assert (tmp_path / "r" / "latest").resolve().name == f"step-{interrupted.max_steps:06d}"  # ...with one there
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
    with pytest.raises(StoreMismatch, match="tokenizer_hash: store has"):
        Trainer(replace(c, save_path=str(tmp_path / "r"), verifier_name_or_path=str(other)), progress=False)


def test_reduced_draft_vocab_trains(reference_run, tmp_path):
    c, _ = reference_run
    records = fit(replace(c, save_path=str(tmp_path / "r"), draft_vocab_size=128, epochs=1))
    assert all(torch.isfinite(torch.tensor(r["metrics"]["loss"])) for r in records)
    ckpt = (tmp_path / "r" / "latest").resolve()
    assert json.loads((ckpt / "config.json").read_text())["draft_vocab_size"] == 128
    weights = load_file(ckpt / "model.safetensors")
    assert weights["d2t"].shape == (128,) and weights["lm_head.weight"].shape[0] == 128


def test_bf16_autocast_trains_on_cpu_with_fp32_weights(reference_run, tmp_path):
    c, reference = reference_run
    records = fit(replace(c, save_path=str(tmp_path / "r"), autocast="bf16", max_steps=3))
    ours, theirs = ([r["metrics"]["loss"] for r in rs if r["split"] == "train"][:3] for rs in (records, reference))
    # step 1 is the same untrained drafter on the same batch: only the forward's precision differs
    assert ours[0] != theirs[0] and ours[0] == pytest.approx(theirs[0], rel=0.05)
    assert all(torch.isfinite(torch.tensor(ours)))
    weights = load_file((tmp_path / "r" / "latest").resolve() / "model.safetensors")
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("autocast, inputs", [("bf16", torch.bfloat16), ("off", torch.float32)])
def test_inputs_take_bf16_under_autocast_and_the_weights_dtype_without(autocast, inputs, reference_run, tmp_path,
                                                                      monkeypatch):
    """One dtype policy, as CUDA runs it: bf16 batches (a bf16 store) train and validate, with autocast in bf16 and
    without it in the weights' fp32 (`--autocast off` on CUDA fed bf16 into fp32 weights and crashed)."""
    from dspark.train.data import TrainData

    collate, seen = TrainData.collate, set()

    def bf16(self, samples):
        batch = collate(self, samples)
        return batch and {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}

    monkeypatch.setattr(TrainData, "collate", bf16)
    c, _ = reference_run
    tr = Trainer(replace(c, save_path=str(tmp_path / "r"), autocast=autocast, max_steps=2, val_state_gain=True),
                 progress=False)
    tr.model.register_forward_pre_hook(lambda _, args, kw: seen.add(kw["hidden_states"].dtype), with_kwargs=True)
    tr.fit()
    assert seen == {inputs}
    records = MetricLog(tmp_path / "r" / "metrics.jsonl").read()
    assert all(torch.isfinite(torch.tensor(r["metrics"]["loss"])) for r in records)
    val = tr.validate()  # scores blocks with the controls too (`score_with_controls`)
    assert torch.isfinite(torch.tensor(val["loss"])) and "state_gain_tau" in val


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
    from dspark.train.model import load_checkpoint

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


def test_a_cuda_launch_sets_its_gpu_then_names_it_to_nccl(monkeypatch):
    """As speculators' trainer starts NCCL: the rank's GPU set first, then bound to the communicator (`device_id`);
    without it every rank's first collective may guess GPU 0."""
    import torch.distributed as dist

    from dspark.train.loop import setup_distributed

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    d = setup_distributed("cuda")
    assert calls == [("set_device", 1), ("nccl", {"device_id": torch.device("cuda", 1)})]
    assert (d.rank, d.world, d.local_rank) == (1, 2, 1)


@pytest.mark.parametrize("kind", [{"speculator_type": "dspark"},
                                  {"speculator_type": "dspark", "markov_head_type": "rnn"},
                                  {"speculator_type": "dflash"}, {"speculator_type": "eagle3"}])
def test_every_kinds_step_gives_each_trainable_weight_a_gradient(kind, reference_run, tmp_path):
    """What DDP without find_unused_parameters (its per-step graph search) relies on: a weight left out of a step
    would hang the gradient all-reduce."""
    from dspark.train.model import model_inputs

    c, _ = reference_run
    tr = Trainer(replace(c, save_path=str(tmp_path / "r"), **kind), progress=False)
    try:
        batch = tr.data.collate([tr.data.read(i) for i in tr.epoch_plan[0][0]])
        _, loss, _ = tr.model(**tr.place(model_inputs(tr.cfg, batch)), **tr.loss_kw)
        loss.backward()
        trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
        assert trainable and [n for n, p in tr.model.named_parameters() if p.requires_grad and p.grad is None] == []
    finally:
        tr.unlock()


@pytest.mark.slow
def test_two_process_gloo_run_trains(store, prepared, verifier, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # children: two ranks are two processes
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
         "-m", "dspark.cli", "train", "--store", store, "--data-path", prepared, "--verifier-name-or-path", verifier,
         "--save-path", tmp_path / "ddp", "--target-layer-ids", *map(str, LAYERS), "--max-anchors", "32",
         "--markov-rank", "16", "--total-seq-len", "512", "--epochs", "1", "--log-freq", "2", "--lr", "3e-3",
         "--no-progress", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = MetricLog(tmp_path / "ddp" / "metrics.jsonl").read()
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


def test_kill_9_mid_run_then_rerun_matches_the_uninterrupted_run(reference_run, store, prepared, verifier, tmp_path):
    """The uninterrupted run is the session's reference run (the same settings as these flags); the killed one is a
    child process, because kill -9 is the claim."""
    import signal
    import time

    _, reference = reference_run
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", *map(str, train_argv(store, prepared, verifier, run))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def logged_past_checkpoint() -> bool:
        latest = run / "latest"
        if not latest.exists():
            return False
        ckpt_step = int(latest.resolve().name.split("-")[1])
        return any(r["step"] > ckpt_step + 1 for r in MetricLog(run / "metrics.jsonl").read())

    deadline = time.time() + 300
    while not logged_past_checkpoint() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(MetricLog(run / "metrics.jsonl").read()) < len(reference)
    resumed = run_cli(*train_argv(store, prepared, verifier, run), check=False)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr
    assert [r["metrics"] for r in MetricLog(run / "metrics.jsonl").read()] == \
           [r["metrics"] for r in reference]


def train_argv(store, prepared, verifier, save, *extra) -> list:
    """`dspark train` flags equal to conftest's train_cfg."""
    return ["train", "--store", store, "--data-path", prepared, "--verifier-name-or-path", verifier,
            "--save-path", save, "--target-layer-ids", *LAYERS, "--max-anchors", "32", "--markov-rank", "16",
            "--total-seq-len", "512", "--epochs", "2", "--checkpoint-freq", "0.5", "--log-freq", "1",
            "--lr", "3e-3", "--num-workers", "1", "--prefetch-factor", "2", "--no-progress", "--device", "cpu",
            *extra]


def reject_constant(name):
    raise AssertionError(f"not strict JSON: {name}")


def train_records(records: list[dict]) -> list[tuple]:
    """What an exact resume must reproduce: every record but its timing."""
    return [(r["step"], r["split"], r["metrics"]) for r in records]


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_trainer_state_is_refused_in_one_line_and_runs_nothing(reference_run, store, prepared, verifier,
                                                                         tmp_path):
    c, _ = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    marker = tmp_path / "MARKER"
    state = (run / "latest").resolve() / "trainer_state.pt"
    torch.save({"state": Exploit(marker)}, state)
    (state.parent / "checksums.json").unlink()  # a crafted folder drops (or forges) the checksums that would catch it
    proc = run_cli(*train_argv(store, prepared, verifier, run), check=False, cwd=tmp_path)
    assert proc.returncode == 2 and not marker.exists()
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {state} is not a safe checkpoint: it names posix.system") and "fix:" in line


def test_a_checkpoint_of_an_earlier_dspark_still_loads_under_weights_only(tmp_path):
    import random

    import numpy as np

    np.random.seed(3), random.seed(3), torch.manual_seed(3)
    legacy = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save({"rng": [legacy]}, tmp_path / "trainer_state.pt")  # numpy's ndarray tuple, python's tuple
    want = (np.random.rand(), random.random(), torch.rand(1))
    set_rng_state(load_trainer_state(tmp_path)["rng"][0])
    assert (np.random.rand(), random.random(), torch.rand(1)) == want
    torch.save({"rng": [rng_state()]}, tmp_path / "trainer_state.pt")  # today's form round-trips too
    want = (np.random.rand(), random.random(), torch.rand(1))
    set_rng_state(load_trainer_state(tmp_path)["rng"][0])
    assert (np.random.rand(), random.random(), torch.rand(1)) == want


@pytest.fixture(scope="module")
def reference_log10(store, prepared, verifier, tmp_path_factory):
    """An uninterrupted run logging every 10 steps: checkpoints at 8, 16, 24 fall between log points."""
    c = cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "ref10", log_freq=10)
    return c, fit(c)


@pytest.mark.parametrize("how", ["stopped by --max-steps 15", "killed mid-append after the checkpoint at 16"])
def test_resume_between_log_points_logs_what_the_uninterrupted_run_logs(reference_log10, tmp_path, capsys, how):
    c, reference = reference_log10
    run = tmp_path / "r"
    if how.startswith("stopped"):
        fit(replace(c, save_path=str(run), max_steps=15))
        assert (run / "latest").resolve().name == "step-000015"
    else:
        fit(replace(c, save_path=str(run), max_steps=22))  # logs step 20, past the checkpoint at 16
        os.unlink(run / "latest")
        os.symlink("checkpoints/step-000016", run / "latest")  # the kill came before the one at 22
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 21, "epoch": 1, "split": "tr')  # and cut an append short
    capsys.readouterr()
    resumed = fit(replace(c, save_path=str(run)))
    assert train_records(resumed) == train_records(reference)
    assert capsys.readouterr().err.count("dropped a half-written last line") == (how.startswith("killed"))


def test_replay_names_a_damaged_metrics_line(reference_run, tmp_path):
    c, _ = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_cli("replay", run, "--no-progress", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {run}/metrics.jsonl line 3 is not a whole JSON record (damaged or half-written) (fix: delete "
        "that line or restore the file; a resumed run drops a half-written last line by itself)"]


def test_max_steps_before_any_checkpoint_prints_strict_json_and_resumes_from_there(store, prepared, verifier,
                                                                                    tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*train_argv(store, prepared, verifier, run, "--max-steps", "3"))
    result = json.loads(proc.stdout, parse_constant=reject_constant)
    assert result["steps"] == 3 and result["best_val_loss"] is None  # no validation yet
    assert result["latest"] == str((run / "checkpoints" / "step-000003").resolve())


class FakeModel:
    """save_pretrained as speculators does it: config.json and model.safetensors, `size` floats."""

    def __init__(self, size: int):
        self.size = size

    def save_pretrained(self, path):
        from safetensors.torch import save_file

        (path / "config.json").write_text("{}")
        save_file({"w": torch.zeros(self.size)}, path / "model.safetensors")


def enospc(*_, **__):
    raise OSError(28, "No space left on device")


def assert_failed_save_left_latest(run: RunDir, err: CheckpointError) -> None:
    assert str(err).startswith(f"could not save checkpoint step-000002 to {run.root / 'checkpoints'}: "
                               "No space left on device (fix: free disk space and rerun the same command: "
                               f"training resumes from the last checkpoint {run.root.resolve() / 'checkpoints'}")
    assert "\n" not in str(err)
    assert sorted(p.name for p in (run.root / "checkpoints").iterdir()) == ["step-000001"]  # no temp folder
    assert run.checkpoint("latest").name == "step-000001"


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_latest(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.save(1, FakeModel(4), {"state": {"step": 1}}, best=True)
    monkeypatch.setattr(FakeModel, "save_pretrained", enospc)
    with pytest.raises(CheckpointError) as err:
        run.save(2, FakeModel(4), {"state": {"step": 2}}, best=True)
    assert_failed_save_left_latest(run, err.value)
    assert run.checkpoint("best").name == "step-000001"


@pytest.mark.parametrize("too_big", ["weights", "trainer state"])
def test_a_really_full_disk_while_checkpointing_is_one_line_and_keeps_latest(tiny_fs, too_big):
    run = RunDir(tiny_fs / "run")
    run.save(1, FakeModel(1024), {"state": {"step": 1}}, best=False)
    big = 1 << 20  # 4 MiB of floats on a 2 MiB disk
    with pytest.raises(CheckpointError) as err:  # torch and safetensors each word ENOSPC their own way
        run.save(2, FakeModel(big if too_big == "weights" else 1024),
                 {"state": {"step": 2}, "big": torch.zeros(big if too_big == "trainer state" else 1)}, best=False)
    assert_failed_save_left_latest(run, err.value)
    assert load_trainer_state(run.checkpoint("latest"))["state"] == {"step": 1}


def test_export_refuses_a_folder_that_is_not_an_earlier_export_of_the_checkpoint(reference_run, tmp_path):
    c, _ = reference_run
    latest = (Path(c.save_path) / "latest").resolve()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused = run_cli("export", latest, "--output", out, "--verifier-name", "Org/Tiny", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: --output {out} is not empty and is not an export of {latest} (fix: pass a new or empty folder, "
        "or --force to overwrite the files export writes there)"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    run_cli("export", latest, "--output", out, "--verifier-name", "Org/Tiny", "--force")
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    again = tmp_path / "again"
    for _ in range(2):  # rerunning an export of the same checkpoint is fine...
        run_cli("export", latest, "--output", again, "--verifier-name", "Org/Tiny")
    other = next(p for p in (Path(c.save_path) / "checkpoints").iterdir() if p != latest)
    proc = run_cli("export", other, "--output", again, "--verifier-name", "Org/Tiny", check=False)
    assert proc.returncode == 2 and "is not an export of" in proc.stderr  # ...another checkpoint's is not


def test_replay_compares_a_metric_written_as_null_and_tells_it_from_a_missing_one():
    from dspark.replay import first_divergence

    def rec(**metrics):
        return [{"step": 1, "split": "train", "metrics": metrics}]

    assert first_divergence(rec(loss=None), rec(loss=None), 0.0) is None  # NaN both times: reproduced
    assert first_divergence(rec(loss=None), rec(loss=1.5), 0.0) == "record 0 (step 1, train): loss recorded None, replayed 1.5"
    assert first_divergence(rec(loss=1.0), rec(), 0.0) == "record 0 (step 1, train): metric loss only in the record"



def parked_on_its_end_marker(thread) -> bool:
    """Whether the thread waits in Queue.put with the end-of-pass marker (None): the queue is full."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "put" and frame.f_code.co_filename.endswith("queue.py"):
            return frame.f_locals.get("item", ...) is None
        frame = frame.f_back
    return False


def test_an_error_in_the_step_while_the_loaders_queue_is_full_ends_the_loop_at_once(store, prepared):
    """The step raising (OOM, divergence, Ctrl-C) with the last batches queued: the loader thread, blocked on
    its full queue, must let the loop end instead of hanging the rank (and under torchrun the whole job)."""
    import threading

    from dspark.connector.zarr.reader import ZarrStore
    from dspark.data.prepare import PreparedData
    from dspark.train.data import Loader, TrainData

    data = TrainData(ZarrStore(store), PreparedData(prepared), 512, 0.9, 0, "skip")  # nothing kept: read on a thread
    loader = Loader(data, data.epoch_batches(0)[:2], num_workers=1, prefetch=1)
    raised = []

    def train():
        try:
            for _ in loader:  # batch 1 trains while batch 2 fills the queue and the end marker waits
                producer = next(t for t in threading.enumerate() if t.name == "dspark-loader")
                wait_for(lambda: parked_on_its_end_marker(producer), 10, "the loader to block on its full queue")
                raise RuntimeError("CUDA out of memory")
        except RuntimeError as e:
            raised.append(str(e))

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the training loop hung joining its loader"
    assert raised == ["CUDA out of memory"]


def test_dpace_weighs_block_positions_with_ce_alone(store, prepared, verifier, tmp_path):
    """--per-position-loss-weight dpace (speculators' D-PACE) reaches the loss, trains, and is refused beside TV,
    whose elementwise loss it would read as a CE."""
    from speculators.models.dspark import DSparkDraftModel

    from dspark.train.model import loss_kwargs

    with pytest.raises(InputError, match=r"dpace weighs positions by the CE's own confidence.*\(fix: pass --loss-fn ce"):
        cfg(store, prepared, verifier, tmp_path / "r0", per_position_loss_weight="dpace").validate()
    # EAGLE-3 reads no position weights: a config that sets them for block drafters trains it with its own loss
    cfg(store, prepared, verifier, tmp_path / "r2", per_position_loss_weight="dpace", speculator_type="eagle3",
        loss_fn="kl_div").validate()
    c = cfg(store, prepared, verifier, tmp_path / "r1", per_position_loss_weight="dpace", dpace_alpha=0.3,
            loss_fn="ce", max_steps=2, epochs=1).validate()
    kw = loss_kwargs(DSparkDraftModel.__new__(DSparkDraftModel), c, torch.device("cpu"))
    assert (kw["per_position_loss_weight"], kw["dpace_alpha"]) == ("dpace", 0.3)
    losses = [r["metrics"]["loss"] for r in fit(c) if r["split"] == "train"]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
