"""Records dspark reads back (run folders, trackers.json, replays/, regenerate records): a tampered one is one line
naming the file and field, a copied run writes only into itself, and a record never cuts a file it does not match."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import fit, run_cli, train_cfg
from dspark.core.errors import InputError
from dspark.eval.config import TeacherForcedConfig
from dspark.eval.teacher_forced import run_eval
from dspark.data.regenerate import RegenerateConfig, regenerate
from dspark.replay import replay
from dspark.train.config import ReplayConfig
from dspark.train.loop import Trainer
from test_train import train_argv


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def files(folder: Path) -> dict:
    """Every file's bytes and mtime: what "untouched" means."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# tamper -> (what it does, the start of the error line after the run folder, the commands that read that file)
TAMPERS = {
    "config_not_json": (lambda r: (r / "config.json").write_text("{"), "config.json is not JSON",
                        ("replay", "eval", "resume")),
    "no_train": (lambda r: edit_json(r / "config.json", lambda d: d.pop("train")),
                 "config.json: field train is missing, expected an object", ("replay", "eval", "resume")),
    "no_store_fingerprint": (lambda r: edit_json(r / "config.json", lambda d: d.pop("store_fingerprint")),
                             "config.json: field store_fingerprint is missing, expected a string",
                             ("replay", "eval", "resume")),
    "epochs_x": (lambda r: edit_json(r / "config.json", lambda d: d["train"].update(epochs="x")),
                 'config.json: field train.epochs is "x", expected an integer >= 1 and <= 1000',
                 ("replay", "eval", "resume")),
    "metrics_line_a_list": (lambda r: (r / "metrics.jsonl").write_text("[1, 2]\n"),
                            "metrics.jsonl line 1: the record is [1, 2], expected an object", ("replay", "resume")),
    "replays_a_file": (lambda r: (r / "replays").write_text("x"), "replays is not a folder", ("replay",)),
    "trackers_not_json": (lambda r: (r / "trackers.json").write_text("{"), "trackers.json is not JSON",
                          ("eval", "resume")),
    "trackers_tensorboard_5": (lambda r: (r / "trackers.json").write_text('{"tensorboard": 5}'),
                               "trackers.json: field tensorboard is 5, expected an object", ("eval", "resume")),
}
CASES = [(t, cmd) for t, (_, _, cmds) in TAMPERS.items() for cmd in cmds]


@pytest.mark.parametrize("tamper,command", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_a_tampered_run_folder_is_one_line_naming_the_file_and_field(reference_run, store, tmp_path, tamper,
                                                                     command):
    c, _ = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    change, said, _ = TAMPERS[tamper]
    change(run)
    before = files(run)
    with pytest.raises(InputError) as err:
        if command == "replay":
            replay(ReplayConfig(run=str(run)), progress=False)
        elif command == "eval":
            run_eval(TeacherForcedConfig(checkpoint=str(run / "latest"), store=str(store),
                                         output=str(tmp_path / "eval"), split="val", device="cpu"), progress=False)
        else:
            Trainer(replace(c, save_path=str(run)), progress=False)
    assert str(err.value).startswith(f"{run}/{said}") and "(fix: " in str(err.value)
    assert files(run) == before  # nothing of the run was touched


def test_a_record_of_an_older_dspark_without_the_settings_added_since_still_reads(reference_run, tmp_path):
    from dspark.train.config import TrainConfig

    c, _ = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    edit_json(run / "config.json", lambda d: [d["train"].pop(k) for k in ("autocast", "muon_ns_dtype", "live")])
    assert TrainConfig.load(run).autocast == TrainConfig.load(c.save_path).autocast


@pytest.mark.parametrize("command", ["replay", "eval", "train"])
def test_the_cli_says_a_tampered_record_in_one_line(reference_run, store, prepared, verifier, tmp_path, command):
    c, _ = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    edit_json(run / "config.json", lambda d: d["train"].update(epochs="x"))
    argv = {"replay": ["replay", run, "--no-progress"],
            "eval": ["eval", "--checkpoint", run / "latest", "--store", store, "--device", "cpu", "--no-progress",
                     "--output", tmp_path / "eval"],
            "train": train_argv(store, prepared, verifier, run)}[command]
    proc = run_cli(*argv, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f'error: {run}/config.json: field train.epochs is "x", expected an integer >= 1 and <= 1000 '
        "(fix: restore the file from a copy of the run, or train into a new --save-path)"]


def test_a_replay_after_an_earlier_one_was_deleted_replays_afresh(reference_run, tmp_path):
    c, records = reference_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    # `rm -r RUN/replays/000` with 001 present: a finished replay (a copy of the run, as one looks)
    shutil.copytree(c.save_path, run / "replays" / "001", symlinks=True)
    kept = files(run / "replays" / "001")
    result = replay(ReplayConfig(run=str(run)), progress=False)
    assert result["replay"] == str(run / "replays" / "002") and result["reproduced"]
    assert (run / "replays" / "002" / "checkpoints").is_dir()  # trained there, from scratch
    assert files(run / "replays" / "001") == kept


# --- trackers.json ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def logged_run(store, prepared, verifier, tmp_path_factory):
    """A run that logged to TensorBoard and MLflow, stopped after its first checkpoint (a resume has work)."""
    run = tmp_path_factory.mktemp("logged") / "run"
    c = train_cfg(store, prepared, verifier, run, epochs=1, checkpoint_freq=0.5)
    c = replace(c, tracking=replace(c.tracking, logger="tensorboard,mlflow"))
    records = fit(replace(c, max_steps=8))
    return c, records


def test_trackers_json_records_places_in_the_run_relative_to_it(logged_run):
    c, _ = logged_run
    ids = json.loads((Path(c.save_path) / "trackers.json").read_text())
    assert ids["tensorboard"] == {"log_dir": "tensorboard"}
    assert ids["mlflow"]["store"] == "mlruns" and "tracking_uri" not in ids["mlflow"]


@pytest.mark.parametrize("record", ["relative", "absolute (older dspark)"])
def test_eval_of_a_copied_run_logs_into_the_copy_and_leaves_the_original_untouched(logged_run, store, tmp_path,
                                                                                   record):
    c, _ = logged_run
    original, copy = Path(c.save_path), tmp_path / "run2"
    shutil.copytree(original, copy, symlinks=True)  # cp -a RUN RUN2
    if record != "relative":  # as dspark wrote trackers.json before: absolute paths into the run it ran in
        edit_json(copy / "trackers.json", lambda d: (
            d["tensorboard"].update(log_dir=str(original / "tensorboard")),
            d["mlflow"].update(tracking_uri=(original / "mlruns").as_uri()), d["mlflow"].pop("store")))
    before = files(original)
    run_eval(TeacherForcedConfig(checkpoint=str(copy / "latest"), store=str(store), output=str(tmp_path / "eval"),
                                 split="val", device="cpu", max_anchors=8), progress=False)
    assert files(original) == before
    from test_tracking import mlflow_series, tensorboard_series

    assert any(k.startswith("eval/") for k in tensorboard_series(copy, ("eval/",))[1])
    assert any(k.startswith("eval/") for k in mlflow_series(copy, ("eval/",)))
    assert list((copy / "mlruns").rglob("artifacts/eval/step-*/eval.png"))  # the plot, beside its metrics


def test_a_new_tracking_uri_on_resume_is_said_and_gets_the_whole_history(logged_run, tmp_path, capfd):
    c, _ = logged_run
    run = tmp_path / "run"
    shutil.copytree(c.save_path, run, symlinks=True)
    other = (tmp_path / "server").as_uri()
    records = fit(replace(c, save_path=str(run), tracking=replace(c.tracking, tracking_uri=other)))
    err = capfd.readouterr().err
    assert (f"note: --tracking-uri {other} is not the MLflow store this run logged to ({(run / 'mlruns').as_uri()}):"
            " a new MLflow run there gets the whole history") in err
    ids = json.loads((run / "trackers.json").read_text())
    assert ids["mlflow"]["tracking_uri"] == other and "store" not in ids["mlflow"]
    from test_tracking import expected, mlflow_series

    want = {k: [s for s, _ in v] for k, v in expected(run).items()}
    got = {k: [s for s, _ in v] for k, v in mlflow_series(run).items()}
    assert got == want and max(r["step"] for r in records) > 8  # steps before and after the resume


# --- regenerate records ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def regenerated(verifier, chat_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "out.jsonl"
    cfg = RegenerateConfig(model=str(verifier), data=str(chat_file), output=str(out), max_new_tokens=4,
                           max_prompts=3, batch_size=1, dtype="float32")
    regenerate(cfg, progress=False)
    return cfg, out


@pytest.mark.parametrize("field,value,said", [
    ("done", "x", 'field done is "x", expected an integer >= 0'),
    ("bytes", -5, "field bytes is -5, expected an integer >= 0"),
    ("settings", None, "field settings is null, expected an object"),
    ("bytes", "mid-line", "field bytes is {n}, but that much of {out} ends mid-line"),
    ("bytes", "first line", "field bytes is {n}, but that much of {out} holds 1 lines, not the 3 written")])
def test_a_regenerate_record_that_does_not_match_is_refused_and_cuts_nothing(regenerated, tmp_path, field, value,
                                                                             said):
    cfg, done = regenerated
    out = tmp_path / "out.jsonl"
    shutil.copy(done, out)
    shutil.copy(f"{done}.regenerate.json", f"{out}.regenerate.json")
    text = out.read_bytes()
    assert text.count(b"\n") == 3
    value = {"mid-line": len(text) - 3, "first line": text.index(b"\n") + 1}.get(value, value)
    edit_json(Path(f"{out}.regenerate.json"), lambda d: d.update({field: value}))
    record = Path(f"{out}.regenerate.json").read_bytes()
    said = f"{out}.regenerate.json: " + said.format(n=value, out=out)
    if field == "bytes" and value == len(text) - 3:  # the case, end to end: it was rc 0, "nothing to do"
        proc = run_cli("regenerate", "--model", cfg.model, "--data", cfg.data, "--output", out, "--max-new-tokens",
                       "4", "--max-prompts", "3", "--dtype", "float32", "--no-progress", check=False)
        assert proc.returncode == 2
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {said}") and "(fix: " in line
    else:
        with pytest.raises(InputError) as err:
            regenerate(replace(cfg, output=str(out)), progress=False)
        assert str(err.value).startswith(said) and "(fix: " in str(err.value)
    assert out.read_bytes() == text and Path(f"{out}.regenerate.json").read_bytes() == record
