"""docker/bin/dspark-compose, the steps compose.yaml runs, on the host (no Docker needed): the
servers stop once the pipeline is done (so `docker compose up` returns), and a failed training
run still marks it done. scripts/docker-e2e.sh runs the same steps in the images."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.core.net import free_port

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "docker" / "bin" / "dspark-compose"


def step_env(cache: Path, **extra: str) -> dict:
    # The venv's bin first: dspark and mooncake_master, as on the images' PATH.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "DSPARK_CACHE_DIR": str(cache), "DSPARK_NAME": "t",
            "DSPARK_CONFIG": str(ROOT / "configs" / "cpu.yaml"), **extra}


# The compose step script (bash) runs as compose runs it: a child process, with the environment compose sets.
def healthy(url: str, env: dict) -> bool:
    return subprocess.run([str(STEP), "health", url], env=env, capture_output=True).returncode == 0


def wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_server_step_runs_until_the_pipeline_is_done(tmp_path):
    port = free_port("127.0.0.1")
    env = step_env(tmp_path, MOONCAKE_PORT=str(port), MOONCAKE_METRICS_PORT=str(free_port("127.0.0.1")))
    done = tmp_path / ".compose" / "t.done"
    done.parent.mkdir()
    done.write_text("train exited with status 0")
    os.utime(done, (time.time() - 60, time.time() - 60))  # an earlier `up`'s marker: not ours
    assert not healthy(f"tcp://127.0.0.1:{port}", env)
    proc = subprocess.Popen([str(STEP), "master"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait(lambda: healthy(f"tcp://127.0.0.1:{port}", env), 30), "the master never answered"
        time.sleep(3)  # a few polls of the old marker
        assert proc.poll() is None, "stopped by the previous run's marker"
        done.write_text("train exited with status 0")
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert "the pipeline is done (train exited with status 0): stopping mooncake_master" in out
    assert wait(lambda: not healthy(f"tcp://127.0.0.1:{port}", env), 10), "the master outlived its step"


def test_a_server_that_fails_fails_its_step(tmp_path):
    env = step_env(tmp_path, MOONCAKE_PORT="not-a-port")
    assert subprocess.run([str(STEP), "master"], env=env, capture_output=True, timeout=60).returncode != 0


def test_failed_training_still_marks_the_pipeline_done(tmp_path):
    """Otherwise the master and the extractor would wait forever and `docker compose up` never return."""
    proc = subprocess.run([str(STEP), "train", "mooncake"], env=step_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    marker = (tmp_path / ".compose" / "t.done").read_text()
    assert marker == f"train exited with status {proc.returncode}\n"


def test_unknown_step_and_source_are_one_line_errors(tmp_path):
    for args in (["bogus"], ["train", "s3"]):
        proc = subprocess.run([str(STEP), *args], env=step_env(tmp_path), capture_output=True, text=True)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "error:" in proc.stderr
