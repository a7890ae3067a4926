"""The GPU checks' own machinery, on the CPU: both scripts' dry runs end to end, the step runner that records a
failure and goes on, and the readiness wait that fails at once on a dead server.

The dry runs check the scripts' plumbing, not the pipeline (other files test that): they are given the session's
verifier, prepared data, store and trained run (DSPARK_GPU_CHECK_*), and build only what they check."""

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["gpu_check.sh", "gpu_check_device.sh", "gpu_check_common.sh", "gpu_wheels.sh"]


def lib(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_check_lib.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def contents(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def given(verifier, prepared, store, run=None) -> dict[str, str]:
    """The session's inputs, for the scripts to link in place of building them."""
    env = {"DSPARK_GPU_CHECK_VERIFIER": verifier, "DSPARK_GPU_CHECK_PREPARED": prepared,
           "DSPARK_GPU_CHECK_STORE": store, "DSPARK_GPU_CHECK_RUN": run}
    return {k: str(v) for k, v in env.items() if v is not None}


def dry_run(script: str, out: Path, **env) -> list[str]:
    inputs = [Path(env[k]) for k in sorted(env) if k.startswith("DSPARK_GPU_CHECK_")]
    before = [contents(p) for p in inputs]
    proc = subprocess.run(["bash", f"scripts/{script}", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
                          timeout=540)
    summary = (out / "summary.txt").read_text().splitlines()
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{(out / 'failures.txt').read_text()[-3000:]}"
    assert (out / "failures.txt").read_text() == ""
    assert (out / "logs.tar.gz").stat().st_size > 0
    assert [contents(p) for p in inputs] == before, "a dry run wrote into the session's inputs it was given"
    return summary


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_gpu_check_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", f"scripts/{script}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_device_check_dry_run_passes_every_step_on_the_cpu(tmp_path, verifier, prepared, store):
    """Over 20 s: each step it checks is a process paying torch's imports (~7 s): a bf16 extraction, eval, a DDP
    smoke test under torchrun and the five trainings it checks (plain, autocast off, under torchrun, resumed in two
    halves)."""
    summary = dry_run("gpu_check_device.sh", tmp_path, **given(verifier, prepared, store))
    steps = [line.split()[1] for line in summary]
    assert steps == ["toy-verifier", "prepare", "extract-fp32-cpu", "extract-bf16-cpu", "compare-bf16", "train",
                     "train-metrics", "eval", "train-autocast-off", "train-autocast-off-metrics", "ddp-nccl",
                     "train-torchrun", "resume-half", "resume-rest", "resume-equal"]
    assert all(line.startswith("ok") for line in summary), summary
    assert any("bitwise equal" in line for line in summary)
    assert [line.split()[1] for line in summary if "given: " in line] == steps[:3]


@pytest.mark.slow
def test_the_vllm_check_dry_run_probes_an_abort_and_skips_only_what_needs_vllm_or_cuda(tmp_path, verifier, prepared,
                                                                                       store, reference_run):
    """Over 20 s: each step it checks is a process paying torch's imports (~7 s): a bf16 extraction, the
    `dspark serve` the abort probe drops a request on, store verify, export and eval --decode."""
    summary = dry_run("gpu_check.sh", tmp_path, PORT=str(free_port()),
                      **given(verifier, prepared, store, reference_run[0].save_path))
    assert [line.split()[1].rstrip(":") for line in summary if line.startswith("dry")] == \
        ["vllm-v2", "vllm-v1", "vllm-tp2", "serve-draft"]
    assert all(line.startswith(("ok", "dry")) for line in summary), summary
    assert any(line.startswith("ok   abort-absent-or-whole") for line in summary)
    assert [line.split()[1] for line in summary if "given: " in line] == \
        ["toy-verifier", "prepare", "extract-fp32-cpu", "train"]


def test_a_failed_step_is_recorded_with_its_log_and_the_next_step_runs(tmp_path):
    code = (". scripts/gpu_check_common.sh; step broken 30 sh -c 'echo the reason; exit 3'; "
            "step fine 30 echo done; finish")
    proc = subprocess.run(["bash", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DRY": "0", "BUDGET": "60"})
    assert proc.returncode == 1
    assert (tmp_path / "summary.txt").read_text().splitlines()[0].startswith("FAIL broken")
    assert (tmp_path / "summary.txt").read_text().splitlines()[1].startswith("ok   fine")
    assert "the reason" in (tmp_path / "failures.txt").read_text()


def test_a_step_past_the_budget_is_stopped_by_its_timeout(tmp_path):
    """A 2 s budget (a step may start with 1 s left, MIN_STEP) stops a step that asks for 600 s."""
    code = ". scripts/gpu_check_common.sh; step sleepy 600 sleep 30; finish"
    if (late := time.time() % 1) > 0.5:  # bash's $SECONDS ticks on the clock's whole seconds: not just before one
        time.sleep(1 - late)
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DRY": "0", "BUDGET": "2",
                               "MIN_STEP": "1"})
    assert proc.returncode == 1 and time.monotonic() - start < 20
    assert "timed out after 2s" in (tmp_path / "summary.txt").read_text()


def test_the_readiness_wait_fails_at_once_when_the_server_died_and_shows_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("loading\nCUDA out of memory\n")
    dead = subprocess.Popen(["true"])  # not reaped until the end: a zombie still answers kill -0
    time.sleep(0.5)
    start = time.monotonic()
    proc = lib("wait-ready", f"http://127.0.0.1:{free_port()}", dead.pid, log, 300)
    dead.wait()
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert f"pid {dead.pid}) exited" in proc.stdout and "CUDA out of memory" in proc.stdout


def test_the_readiness_wait_gives_up_after_its_timeout_and_passes_once_health_answers(tmp_path):
    port = free_port()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        proc = lib("wait-ready", f"http://127.0.0.1:{port}", alive.pid, tmp_path / "none.log", 2)
        assert proc.returncode == 1 and "did not answer within 2s" in proc.stdout
    finally:
        alive.kill()
        alive.wait()
    (tmp_path / "health").write_text("ok")
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc = lib("wait-ready", f"http://127.0.0.1:{port}", server.pid, tmp_path / "none.log", 60)
        assert proc.returncode == 0, proc.stdout
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_resume_equality_fails_on_weights_that_differ_beyond_the_tolerance(tmp_path):
    w = torch.randn(16, 16)
    for run, t in (("a", w), ("b", w + 1e-2)):
        (tmp_path / run / "latest").mkdir(parents=True)
        save_file({"layer.weight": t}, tmp_path / run / "latest" / "model.safetensors")
    assert lib("same-weights", tmp_path / "a", tmp_path / "a", "--rel-tol", 0).returncode == 0
    proc = lib("same-weights", tmp_path / "a", tmp_path / "b", "--rel-tol", 1e-3)
    assert proc.returncode == 1 and "not bitwise equal" in proc.stdout
