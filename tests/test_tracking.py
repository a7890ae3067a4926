"""`--logger`: each tracker a real backend, offline, read back with its own reader where it has one.

What a tracker holds must equal RUN/metrics.jsonl step for step (after a kill -9 and a resume too), eval
results reach the run they evaluate, a replay logs nowhere, and a missing or broken tracker never stops
training.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import fit, run_cli, train_cfg
from dspark.train.metrics import MetricLog
from dspark.tracking.run import flatten, read_identity, scalars
from test_train import train_argv

ALL = "tensorboard,mlflow,wandb,trackio"
SHORT = ("--epochs", "1", "--checkpoint-freq", "0.5")


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, at import: set before this process (or a child) imports it."""
    d = tmp_path_factory.mktemp("trackio")
    os.environ["TRACKIO_DIR"] = str(d)
    return d


def expected(run: Path) -> dict[str, list[tuple[int, float]]]:
    out = defaultdict(list)
    for r in MetricLog(run / "metrics.jsonl").read():
        for k, v in scalars(r).items():
            out[k].append((r["step"], v))
    return dict(out)


def identity(run: Path, name: str) -> dict:
    return read_identity(run)[name]


def tensorboard_series(run: Path, prefix=("train/", "val/")):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if t.startswith(prefix)}


def mlflow_client(run: Path):
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as a user reading the run's file store sets it

    return MlflowClient(tracking_uri=identity(run, "mlflow")["tracking_uri"])


def mlflow_series(run: Path, prefix=("train/", "val/")):
    client, run_id = mlflow_client(run), identity(run, "mlflow")["run_id"]
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)]
            for k in client.get_run(run_id).data.metrics if k.startswith(prefix)}


def wandb_rows(run: Path) -> list[dict]:
    from dspark.tracking.backends import wandb_history

    files = sorted((f for f in (run / "wandb").glob("*/run-*.wandb") if not f.parent.is_symlink()),  # latest-run
                   key=lambda f: f.parent.name)
    return [row for f in files for row in wandb_history(f)]


def by_key(rows, step_key, prefix=("train/", "val/")):
    out = defaultdict(list)
    for row in rows:
        for k, v in row.items():
            if k.startswith(prefix):
                out[k].append((row[step_key], v))
    return {k: sorted(v) for k, v in out.items()}


def trackio_rows(run: Path) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    ident = identity(run, "trackio")
    return SQLiteStorage.get_logs(ident["project"], ident["name"])


def assert_series_equal(got: dict, want: dict, rel: float, timed: bool = True, what: str = "") -> None:
    """Same steps, each once; same values (`timed`: timings too, which a step run twice does not repeat)."""
    assert sorted(got) == sorted(want), what
    for k in want:
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]], f"{what} {k}"
        if "/timing/" in k and not timed:
            continue
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in want[k]], rel=rel, abs=1e-7), f"{what} {k}"


def all_series(run: Path) -> dict[str, dict]:
    return {"tensorboard": tensorboard_series(run)[1], "mlflow": mlflow_series(run),
            "wandb": by_key(wandb_rows(run), "_step"), "trackio": by_key(trackio_rows(run), "step")}


# float32 event files; the others keep the float64 of metrics.jsonl
REL = {"tensorboard": 1e-6, "mlflow": 1e-12, "wandb": 1e-12, "trackio": 1e-12}


@pytest.fixture(scope="module")
def tracked_run(store, prepared, verifier, trackio_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("tracked") / "run"
    proc = run_cli(*train_argv(store, prepared, verifier, run, *SHORT, "--logger", ALL, "--log-checkpoints"))
    json.loads(proc.stdout)  # trackers print nothing into the result on stdout
    return run


def test_every_tracker_holds_every_metric_of_metrics_jsonl(tracked_run):
    want = expected(tracked_run)
    assert {"train/loss", "val/loss", "train/accept_len", "train/timing/data_wait_fraction"} <= set(want)
    for name, got in all_series(tracked_run).items():
        assert_series_equal(got, want, REL[name], what=name)


def test_the_config_versions_and_fingerprints_are_the_runs_parameters_and_tags(tracked_run):
    record = json.loads((tracked_run / "config.json").read_text())
    client, run_id = mlflow_client(tracked_run), identity(tracked_run, "mlflow")["run_id"]
    mlrun = client.get_run(run_id)
    assert mlrun.data.params == {k: str(v) for k, v in flatten(record["train"]).items()}
    assert mlrun.data.params["lr"] == "0.003" and mlrun.data.params["live.mooncake.master"] == "127.0.0.1:50051"
    tags = mlrun.data.tags
    assert tags["store_fingerprint"] == record["store_fingerprint"]
    assert tags["prepared_fingerprint"] == record["prepared_fingerprint"]
    assert tags["version.speculators"] == "0.9.0" and tags["mlflow.runName"] == "run"
    assert mlrun.info.status == "FINISHED"
    # checkpoints as artifacts, as --log-checkpoints asked
    ckpts = sorted(p.name for p in (tracked_run / "checkpoints").iterdir())
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == [f"checkpoints/{c}" for c in ckpts]
    files = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(run_id, f"checkpoints/{ckpts[-1]}")}
    assert {"config.json", "model.safetensors", "trainer_state.pt"} <= files

    from trackio.sqlite_storage import SQLiteStorage

    ident = identity(tracked_run, "trackio")
    config = SQLiteStorage.get_run_config(ident["project"], ident["name"])
    assert config["lr"] == 0.003 and config["tags.store_fingerprint"] == record["store_fingerprint"]

    acc, _ = tensorboard_series(tracked_run)
    assert {"config/text_summary", "tags/text_summary"} <= set(acc.Tags()["tensors"])


def test_eval_and_decode_results_go_into_the_run_they_evaluate(tracked_run, chat_file):
    ckpt = (tracked_run / "latest").resolve()
    step = int(ckpt.name.split("-")[1])
    run_cli("eval", "--checkpoint", ckpt, "--decode", "--prompts", f"chats={chat_file}", "--max-prompts", "2",
            "--max-new-tokens", "8", "--no-progress")
    result = json.loads((ckpt / "eval" / "eval.json").read_text())
    decoded = json.loads((ckpt / "eval" / "decode.json").read_text())["datasets"][0]["decoded"]
    tau, mal = result["tau_greedy"], decoded["mean_acceptance_length"]
    pos1 = result["positions"][0]["greedy_match"]

    acc, tb = tensorboard_series(tracked_run, prefix=("eval/",))
    assert tb["eval/val/tau_greedy"] == [(step, pytest.approx(tau, rel=1e-6))]
    assert tb["eval/val/position_1_greedy_match"] == [(step, pytest.approx(pos1, rel=1e-6))]
    assert tb["eval/decode/chats/mean_acceptance_length"] == [(step, pytest.approx(mal, rel=1e-6))]
    assert {"eval/eval", "eval/decode"} <= set(acc.Tags()["images"])

    ml = mlflow_series(tracked_run, prefix=("eval/",))
    assert ml["eval/val/tau_greedy"] == [(step, tau)] and ml["eval/decode/chats/mean_acceptance_length"] == [(step, mal)]
    client, run_id = mlflow_client(tracked_run), identity(tracked_run, "mlflow")["run_id"]
    assert {a.path for a in client.list_artifacts(run_id, f"eval/{ckpt.name}")} == \
           {f"eval/{ckpt.name}/eval.png", f"eval/{ckpt.name}/decode.png"}

    rows = [r for r in wandb_rows(tracked_run) if "eval/step" in r]
    assert by_key(rows, "eval/step", ("eval/val/tau", "eval/decode/chats/mean"))["eval/val/tau_greedy"] == [(step, tau)]
    assert any(r.get("eval/decode/chats/mean_acceptance_length") == mal for r in rows)
    for png in ("eval", "decode"):  # the PNGs, as wandb images
        assert any(r.get(f"eval/{png}/_type") == "image-file" for r in rows), png

    tk = [r for r in trackio_rows(tracked_run) if "eval/val/tau_greedy" in r]
    assert [(r["step"], r["eval/val/tau_greedy"]) for r in tk] == [(step, tau)]
    # the training curves are untouched: eval results sit beside them
    want = expected(tracked_run)
    for name, got in all_series(tracked_run).items():
        assert_series_equal(got, want, REL[name], what=name)


def test_a_replay_logs_to_no_tracker(tracked_run):
    before = all_series(tracked_run)
    result = json.loads(run_cli("replay", tracked_run, "--no-progress").stdout.split("\nREPRODUCED")[0])
    assert result["reproduced"]
    replayed = Path(result["replay"])
    assert not ({"trackers.json", "tensorboard", "mlruns", "wandb"} & {p.name for p in replayed.iterdir()})
    assert all_series(tracked_run) == before


@pytest.mark.slow
def test_kill_9_then_resume_leaves_one_continuous_curve_in_every_tracker(store, prepared, verifier, trackio_dir,
                                                                          tmp_path):
    """Over 20 s: a training of its own in a child (the kill -9 is the claim), resumed in this process."""
    run = tmp_path / "killed"
    args = list(map(str, train_argv(store, prepared, verifier, run, "--epochs", "4", "--checkpoint-freq", "0.125",
                                    "--logger", ALL)))
    argv = [sys.executable, "-m", "dspark.cli", *args]
    # The killed run's own wandb service, as a user's: wandb hands a running service to child
    # processes through WANDB_SERVICE (this one's, once an in-process test used wandb), and that service, alive
    # past the kill, keeps the killed run's stream open and drops the resume of the same run id.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)  # kill -9 is the claim

    def checkpoint_step() -> int:
        return int((run / "latest").resolve().name.split("-")[1])

    def tracker_past_checkpoint() -> bool:  # MLflow holds steps the resume computes again
        # each tracker adds itself to trackers.json once it has started: the resume must reopen every one of them
        if not (run / "latest").exists() or set(ALL.split(",")) - set(read_identity(run)):
            return False
        try:
            steps = [s for s, _ in mlflow_series(run).get("train/loss", [])]
        except ValueError:  # MLflow's file store read mid-write: a metric file created, its first line not yet
            return False
        return bool(steps) and max(steps) > checkpoint_step() + 1

    deadline = time.time() + 300
    while not tracker_past_checkpoint() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert max(s for s, _ in mlflow_series(run)["train/loss"]) > checkpoint_step()
    # The resume in this process: the killed child's wandb service never serves it (this process's does, if any)
    resumed = run_cli(*args, check=False)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr[-2000:]
    want = expected(run)
    assert len(want["train/loss"]) == max(s for s, _ in want["train/loss"])  # every step, from 1
    for name, got in all_series(run).items():  # a step logged before the kill keeps that attempt's timing
        assert_series_equal(got, want, REL[name], timed=False, what=name)


def test_a_step_half_logged_before_a_kill_is_completed_not_repeated(trackio_dir, tmp_path):
    from dspark.tracking.config import TrackingConfig
    from dspark.tracking.run import Tracking

    def record(step, **metrics):
        return {"step": step, "epoch": 0, "split": "train", "metrics": metrics}

    whole = [record(s, loss=1 / s, tv_loss=2 / s) for s in (1, 2, 3)]
    run, cfg = tmp_path / "run", TrackingConfig(logger=ALL)
    run.mkdir()
    # the killed attempt: steps 1 and 2 whole, step 3 cut short between its two keys
    first = Tracking.for_training(run, cfg, {"lr": 0.1}, {}, [*whole[:2], record(3, loss=1 / 3)])
    first.close()
    # the resume sends the record from metrics.jsonl: each tracker gets only the key it lacks
    Tracking.for_training(run, cfg, {"lr": 0.1}, {}, whole).close()
    want = {"train/loss": [(s, 1 / s) for s in (1, 2, 3)], "train/tv_loss": [(s, 2 / s) for s in (1, 2, 3)],
            "train/epoch": [(s, 0.0) for s in (1, 2, 3)]}
    for name, got in all_series(run).items():
        assert_series_equal(got, want, REL[name], what=name)


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_install(store, prepared, verifier, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails, as where it is not installed
    proc = run_cli(*train_argv(store, prepared, verifier, tmp_path / "r", "--logger", "tensorboard,mlflow"),
                   check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: --logger mlflow: the mlflow package is not installed (fix: pip install 'dspark[mlflow]' (or drop "
        "mlflow from --logger))"]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_an_unknown_tracker_is_one_line(store, prepared, verifier, tmp_path):
    proc = run_cli(*train_argv(store, prepared, verifier, tmp_path / "r", "--logger", "tensorbord"), check=False)
    assert proc.returncode != 0 and "unknown tracker 'tensorbord'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_logger_comes_from_a_config_file_and_the_flag_wins(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("tracking:\n  logger: mlflow,tensorboard\n  run_name: sweep-1\n")
    base = ["train", "--config", cfg, "--data-path", "d", "--verifier-name-or-path", "v", "--save-path", "s",
            "--target-layer-ids", "1", "--print-config"]
    printed = json.loads(run_cli(*base).stdout)["tracking"]
    assert printed["logger"] == "mlflow,tensorboard" and printed["run_name"] == "sweep-1"
    assert json.loads(run_cli(*base, "--logger", "wandb").stdout)["tracking"]["logger"] == "wandb"


def test_a_broken_tracker_warns_once_and_training_finishes(store, prepared, verifier, tmp_path, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the MLflow store should be")
    c = train_cfg(store, prepared, verifier, tmp_path / "r", max_steps=4,
                  tracking={"logger": "mlflow", "tracking_uri": (blocker / "mlruns").as_uri()})
    records = fit(c)
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    err = capfd.readouterr().err
    assert err.count("warning: tracker mlflow") == 1
    assert "could not start (NotADirectoryError" in err and "training goes on" in err


def test_a_hung_tracker_server_never_holds_training_up(store, prepared, verifier, tmp_path, capfd, monkeypatch):
    import dspark.tracking.run as tracking_run

    server = socket.socket()  # accepts connections, never answers: a wedged tracking server
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    monkeypatch.setattr(tracking_run, "CLOSE_SECONDS", 1.0)
    c = train_cfg(store, prepared, verifier, tmp_path / "r", max_steps=4,
                  tracking={"logger": "mlflow", "tracking_uri": f"http://127.0.0.1:{server.getsockname()[1]}"})
    try:
        start = time.perf_counter()
        records = fit(c)
        took = time.perf_counter() - start
    finally:
        server.close()
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert took < 60  # MLflow's own wait on an unanswered request is 120 s a try
    assert "trackers mlflow still busy after 1 s" in capfd.readouterr().err


def test_a_tracker_whose_disk_fills_up_warns_once_and_training_finishes(store, prepared, verifier, tmp_path, tiny_fs,
                                                                         capfd):
    import shutil

    room = 384 * 1024  # enough for the MLflow run to start (a page per parameter file), not for its metrics
    (tiny_fs / "filler").write_bytes(b"\0" * (shutil.disk_usage(tiny_fs).free - room))
    c = train_cfg(store, prepared, verifier, tmp_path / "r", max_steps=6,
                  tracking={"logger": "mlflow", "tracking_uri": (tiny_fs / "mlruns").as_uri()})
    records = fit(c)
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    err = capfd.readouterr().err
    assert err.count("warning: tracker mlflow") == 1 and "No space left on device" in err, err[-2000:]
