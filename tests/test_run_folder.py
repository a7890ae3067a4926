"""A run folder under stress: two writers, a lost `latest`, damaged checkpoints, hostile export folders, a NaN loss."""

import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fit, run_cli, wait_for
from dspark.core.errors import CheckpointError, InputError, TrainingDiverged
from dspark.eval.config import TeacherForcedConfig
from dspark.eval.teacher_forced import run_eval
from dspark.export.folder import export
from dspark.core.fsio import temp_path
from dspark.train.checkpoint import RunDir
from dspark.train.loop import Trainer
from dspark.train.metrics import MetricLog
from test_train import FakeModel, train_argv, train_records


def snapshot(run: Path) -> dict:
    """Every checkpoint file's bytes and mtime: what "untouched" means."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}


def copy_run(c, dst: Path) -> Path:
    shutil.copytree(c.save_path, dst, symlinks=True)
    return dst


# --- case 2: one writer per run folder ------------------------------------------------------------------------

def test_a_train_on_a_run_folder_in_use_is_refused_in_one_line_naming_the_holder(store, prepared, verifier,
                                                                                   tmp_path):
    run = tmp_path / "run"
    held = RunDir(run).lock()
    proc = run_cli(*train_argv(store, prepared, verifier, run), check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: run folder {run} is in use by pid {os.getpid()} on {socket.gethostname()} "
                           "since ") and "fix: wait for it to finish" in line
    assert [p.name for p in run.iterdir()] == [".lock"]  # the refused run wrote nothing
    held.release()
    RunDir(run).lock().release()  # free again once released


@pytest.mark.slow
def test_two_identical_trains_at_once_one_is_refused_and_every_step_is_logged_once(reference_run, store, prepared,
                                                                                   verifier, tmp_path):
    _, reference = reference_run
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "dspark.cli", *map(str, train_argv(store, prepared, verifier, run))]
    # a child: it is stopped (SIGSTOP) mid-run while this process starts the second
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run / "config.json").exists() or first.poll() is not None, 120, "the first run to start")
        first.send_signal(signal.SIGSTOP)  # mid-run, deterministically, while the second one starts
        second = run_cli(*train_argv(store, prepared, verifier, run), check=False)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert second.returncode == 2 and f"is in use by pid {first.pid} on {socket.gethostname()}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    records = MetricLog(run / "metrics.jsonl").read()
    assert train_records(records) == train_records(reference)  # each step once, as an uninterrupted run logs it


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    run = tmp_path / "run"
    # a child: the lock's holder is killed, and only a process's death frees an flock
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dspark.train.checkpoint import RunDir; "
                               "RunDir(sys.argv[1]).lock(); print('locked', flush=True); time.sleep(600)", str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(CheckpointError, match=rf"run folder {run} is in use by pid {holder.pid} on "):
            RunDir(run).lock()
    finally:
        holder.kill()
        holder.wait()
    RunDir(run).lock().release()


# --- case 3: a lost `latest` never restarts a run over its checkpoints -------------------------------------------

@pytest.mark.parametrize("how", ["removed", "dangling"])
def test_a_lost_latest_resumes_from_the_newest_checkpoint_and_overwrites_none(reference_run, tmp_path, capsys, how):
    c, reference = reference_run
    run = tmp_path / "r"
    fit(replace(c, save_path=str(run), max_steps=20))
    before = snapshot(run)
    (run / "latest").unlink()
    if how == "dangling":
        os.symlink("checkpoints/step-000099", run / "latest")
    capsys.readouterr()
    resumed = fit(replace(c, save_path=str(run)))
    err = capsys.readouterr().err
    assert f"resuming {run} from step-000020 (epoch 1, step 20)" in err and "newest checkpoint of this run" in err
    assert train_records(resumed) == train_records(reference)
    assert {p: v for p, v in snapshot(run).items() if p in before} == before


def test_latest_pointing_at_another_runs_checkpoint_is_refused(reference_run, tmp_path):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    other = (Path(c.save_path) / "checkpoints" / "step-000016").resolve()
    (run / "latest").unlink()
    os.symlink(other, run / "latest")
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=rf"{run}/latest points outside this run, at {other} \(fix: "):
        Trainer(replace(c, save_path=str(run)), progress=False)
    assert snapshot(run) == before


def test_a_finished_run_that_lost_latest_gets_it_back_on_rerun(reference_run, tmp_path):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    (run / "latest").unlink()
    before = snapshot(run), (run / "metrics.jsonl").read_bytes()
    Trainer(replace(c, save_path=str(run)), progress=False).fit()  # nothing left to train
    assert (run / "latest").resolve() == (run / "checkpoints" / "step-000032").resolve()
    assert (snapshot(run), (run / "metrics.jsonl").read_bytes()) == before


def test_a_save_never_replaces_an_existing_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    run.save(1, FakeModel(4), {"state": {"step": 1}}, best=False)
    before = snapshot(run.root)
    with pytest.raises(CheckpointError, match=r"step-000001 already exists, and a run never overwrites its check"):
        run.save(1, FakeModel(8), {"state": {"step": 1}}, best=False)
    assert snapshot(run.root) == before


def test_a_save_removes_the_temp_folders_a_killed_save_of_that_step_left(tmp_path):
    run = RunDir(tmp_path / "run")
    killed = [temp_path(run.root / "checkpoints" / "step-000001"), run.root / "checkpoints" / "step-000001.tmp"]
    for folder in killed:  # fsio's name, and the one of dspark before it
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    run.save(1, FakeModel(4), {"state": {"step": 1}}, best=False)
    assert [p.name for p in (run.root / "checkpoints").iterdir()] == ["step-000001"]


def test_a_checkpoint_still_being_written_is_refused_by_eval_and_export(reference_run, store, tmp_path):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    writing = temp_path(run / "checkpoints" / "step-000040")  # a save in progress: its checksums come last
    shutil.copytree(run / "latest", writing, ignore=shutil.ignore_patterns("checksums.json"))
    with pytest.raises(InputError, match="is a checkpoint still being written, or left by a save cut short"):
        export(str(writing), str(tmp_path / "export"), "Org/Tiny")
    with pytest.raises(InputError, match="is a checkpoint still being written, or left by a save cut short"):
        run_eval(TeacherForcedConfig(checkpoint=str(writing), store=str(store), output=str(tmp_path / "ev"),
                                     split="val", device="cpu"))
    assert not (tmp_path / "export").exists()


# --- case 4: damaged checkpoints are one line everywhere, and never shipped --------------------------------------

def truncate(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:1000])


def drop_layer_0(ckpt: Path) -> None:
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("layers.0.")}, ckpt / "model.safetensors")


def garble_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")


# how to damage a checkpoint, and what the one line names: with checksums, without
DAMAGE = {"truncated weights": (truncate, "model.safetensors is 1000 bytes", "model.safetensors is not a whole"),
          "weights without layers.0": (drop_layer_0, "model.safetensors is .* bytes, .* when saved",
                                       r"model.safetensors lacks 11 tensors of this drafter \(layers.0."),
          "garbage config": (garble_config, "config.json is 9 bytes", "config.json is not JSON")}


@pytest.mark.parametrize("checksums", ["with checksums", "an old checkpoint without checksums"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_by_resume_eval_and_export(reference_run, store, tmp_path, damage, checksums):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    ckpt = (run / "latest").resolve()
    if checksums != "with checksums":
        for p in (run / "checkpoints").glob("*/checksums.json"):
            p.unlink()
    hurt, *names = DAMAGE[damage]
    named = names[checksums != "with checksums"]
    hurt(ckpt)
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=named):
        Trainer(replace(c, save_path=str(run)), progress=False)
    with pytest.raises(CheckpointError, match=named):
        run_eval(TeacherForcedConfig(checkpoint=str(run / "latest"), store=str(store), output=str(tmp_path / "ev"),
                                     split="val", device="cpu"))
    assert snapshot(run) == before
    # Without checksums, export can check a file's structure but not which tensors the drafter needs (that takes
    # building the drafter, which needs its verifier): a complete-looking file lacking a layer is caught on load.
    if checksums == "with checksums" or damage != "weights without layers.0":
        out = tmp_path / "export"
        with pytest.raises(CheckpointError, match=named):
            export(str(run / "latest"), str(out), "Org/Tiny")
        assert not out.exists()  # nothing shipped


def test_an_old_checkpoint_without_checksums_still_resumes_and_evaluates(reference_run, store, tmp_path, capsys):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    for p in (run / "checkpoints").glob("*/checksums.json"):
        p.unlink()
    Trainer(replace(c, save_path=str(run)), progress=False)
    result, _ = run_eval(TeacherForcedConfig(checkpoint=str(run / "latest"), store=str(store),
                                             output=str(tmp_path / "ev"), split="val", device="cpu", max_anchors=64))
    assert result["blocks"] > 0
    assert "has no checksums.json (saved by an earlier dspark): its files are not verified" in capsys.readouterr().err


def test_export_of_a_damaged_checkpoint_is_one_line_and_ships_nothing(reference_run, tmp_path):
    c, _ = reference_run
    run = copy_run(c, tmp_path / "r")
    ckpt = (run / "latest").resolve()
    truncate(ckpt)
    out = tmp_path / "export"
    proc = run_cli("export", run / "latest", "--output", out, "--verifier-name", "Org/Tiny", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: checkpoint {ckpt} is damaged: model.safetensors is 1000 bytes, "
        f"{(Path(c.save_path) / 'latest' / 'model.safetensors').stat().st_size} when saved (fix: restore it from a "
        "copy or use another checkpoint; a resumed run needs it deleted: training then continues from the "
        "newest intact checkpoint)"]
    assert not out.exists()


# --- case 5: export never writes through a symlink ---------------------------------------------------------------

def test_export_replaces_symlinks_in_its_output_instead_of_writing_through_them(reference_run, tmp_path):
    c, _ = reference_run
    latest = Path(c.save_path) / "latest"
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    export(str(latest), str(out), "Org/Tiny")
    card, weights = elsewhere / "card.md", elsewhere / "weights.bin"
    card.write_text("not yours")
    weights.write_text("not yours either")
    (out / "README.md").unlink()
    os.symlink(card, out / "README.md")
    export(str(latest), str(out), "Org/Tiny")  # an earlier export of this checkpoint: no --force needed
    (out / "model.safetensors").unlink()
    os.symlink(weights, out / "model.safetensors")
    export(str(latest), str(out), "Org/Tiny", force=True)
    assert card.read_text() == "not yours" and weights.read_text() == "not yours either"
    assert not (out / "README.md").is_symlink() and "vllm serve Org/Tiny" in (out / "README.md").read_text()
    assert not (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").read_bytes() == (latest / "model.safetensors").read_bytes()


def test_export_to_a_dangling_symlink_is_one_line(reference_run, tmp_path):
    c, _ = reference_run
    out = tmp_path / "out"
    os.symlink(tmp_path / "gone", out)
    proc = run_cli("export", Path(c.save_path) / "latest", "--output", out, "--verifier-name", "Org/Tiny", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --output {out} is a symlink to {tmp_path / 'gone'}, which does not exist (fix: create that "
        "folder, or pass a new or empty folder)"]
    assert not (tmp_path / "gone").exists()


# --- case 11 (the loss part): a NaN loss stops the run at the last good checkpoint ------------------------------

class NanLossAt(torch.nn.Module):
    """The trainer's model, but its loss is NaN at one step (what a too-high learning rate ends in)."""

    def __init__(self, step: int, trainer: Trainer):
        super().__init__()
        self.step, self.trainer, self.model = step, trainer, trainer.model

    def forward(self, **kw):
        out, loss, metrics = self.model(**kw)
        return out, loss * (float("nan") if self.trainer.state["step"] + 1 == self.step else 1.0), metrics


def test_a_loss_that_turns_nan_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(reference_run,
                                                                                                 tmp_path):
    c, _ = reference_run
    run = tmp_path / "r"
    trainer = Trainer(replace(c, save_path=str(run)), progress=False)
    trainer.wrapped = NanLossAt(11, trainer)
    with pytest.raises(TrainingDiverged, match=r"^training diverged at step 11 \(epoch 0\): the loss is nan; "
                                          rf"the last good checkpoint {run}/checkpoints/step-000008 is kept"):
        trainer.fit()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000008"]
    assert (run / "latest").resolve().name == "step-000008"
    assert all(torch.isfinite(w).all() for w in load_file(run / "latest" / "model.safetensors").values())
    assert all(r["step"] <= 10 for r in MetricLog(run / "metrics.jsonl").read())
    RunDir(run).lock().release()  # the stopped run let go of its folder
