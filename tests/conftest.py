"""Shared fixtures: one tiny pre-trained verifier, prepared demo data and a store per session."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2-core CI boxes: more threads make tiny steps slower
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: fail fast instead of retrying
os.environ.setdefault("LOGURU_LEVEL", "ERROR")

import json
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark.verifier.toy import ToySpec, build_toy_verifier, demo_chat_path

# Fixtures shared across files: the live services, and one vLLM engine per configuration.
pytest_plugins = ["services", "vllm_engines"]

LAYERS = [1, 3, 5]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Ran:
    """What a `dspark` command left: its exit code and its two streams (a CompletedProcess's fields)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args, check=True, cwd=None, env=None, input=None) -> Ran:
    """Run `dspark` in this process, through click as a user's shell would: its exit code, stdout and stderr.

    One process for the whole suite: the CLI's imports are paid once, not per call (~7 s of CPU each). An
    exception that escapes the CLI is written to stderr as Python writes it, so a test that says "no traceback"
    still fails on one. `env` sets (a value None unsets) variables for the call; `cwd` is the call's folder.
    """
    from click.testing import CliRunner

    from dspark.cli import main

    argv = [str(a) for a in args]
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(main, argv, input=input, env=env, prog_name="dspark", catch_exceptions=True)
    finally:
        os.chdir(here)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(*result.exc_info)[1:])
    ran = Ran(["dspark", *argv], result.exit_code, result.stdout, stderr)
    if check and ran.returncode != 0:
        raise AssertionError(f"dspark {' '.join(argv)} failed ({ran.returncode}):\n{ran.stderr[-3000:]}")
    return ran


def run_process(*args, why: str, check=True, **kw) -> subprocess.CompletedProcess:
    """Run `dspark` in a child process: only where the process is what a test is about (`why` says how: a
    kill, a memory limit, signals, a server, a fresh interpreter's imports)."""
    assert why.strip(), "say in one line why this test needs a child process"
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", *map(str, args)],
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"dspark {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


# Fixtures that train a drafter, or start `dspark serve` or vLLM: a test that takes one is slow by what it
# takes, so `-m "not slow"` never builds them (module fixtures are named as their modules name them).
SLOW_FIXTURES = {"reference_run", "reference_log10", "tracked_run", "logged_run", "regenerated", "no_anchor_run",
                 "decoder", "every_anchor", "dflash_run", "eagle3_run", "live_serve", "live_vllm", "quiet"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 2 MiB filesystem, to fill up for real (needs root; CI runs as root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    build_toy_verifier(out, ToySpec(steps=60))
    return out


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    """The first 80 demo conversations: enough structure, fast to extract."""
    lines = demo_chat_path().read_text().splitlines()[:80]
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def prepared(verifier, chat_file, tmp_path_factory) -> Path:
    from dspark.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("prepared") / "demo"
    prepare(PrepareConfig(model=str(verifier), data=str(chat_file), output=str(out), seq_length=256,
                          minimum_valid_tokens=8), progress=False)
    return out


@pytest.fixture(scope="session")
def store(verifier, prepared, tmp_path_factory) -> Path:
    from dspark.connector.config import SinkConfig, ZarrConfig
    from dspark.extract.config import ExtractConfig
    from dspark.extract.runner import run_extract

    out = tmp_path_factory.mktemp("stores") / "demo"
    run_extract(ExtractConfig(model=str(verifier), data=str(prepared), sink=SinkConfig(zarr=ZarrConfig(store=str(out))),
                              target_layer_ids=LAYERS, batch_tokens=1024), progress=False)
    return out


def train_cfg(store, prepared, verifier, save, **kw):
    from dspark.train.config import TrainConfig

    base = dict(store=str(store), data_path=str(prepared), verifier_name_or_path=str(verifier), save_path=str(save),
                target_layer_ids=LAYERS, block_size=8, max_anchors=32, markov_rank=16, total_seq_len=512,
                epochs=2, checkpoint_freq=0.5, log_freq=1, lr=3e-3, num_workers=1, prefetch_factor=2)
    return TrainConfig.from_dict({**base, **kw})


def fit(c, **kw) -> list[dict]:
    from dspark.train.loop import Trainer
    from dspark.train.metrics import MetricLog

    Trainer(c, progress=False, **kw).fit()
    return MetricLog(Path(c.save_path) / "metrics.jsonl").read()


@pytest.fixture(scope="session")
def reference_run(store, prepared, verifier, tmp_path_factory):
    """A trained tiny drafter: (its TrainConfig, its metric records); shared by training, eval and decode tests."""
    c = train_cfg(store, prepared, verifier, tmp_path_factory.mktemp("runs") / "ref")
    return c, fit(c)


def hf_cache_model(hf_home: Path, repo_id: str, source: Path | None = None, config: dict | None = None) -> Path:
    """Put a model into a Hugging Face cache under `repo_id`, laid out as huggingface_hub downloads it
    (`hub/models--ORG--NAME/snapshots/<commit>/`, `refs/main`): `source`'s files, or a lone config.json."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in (source.iterdir() if source else []):
        shutil.copy(f, snapshot / f.name)
    if config is not None:
        (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def prompt_ids(prepared: Path, n: int) -> list[list[int]]:
    """The first `n` prepared samples, each cut before its first supervised token: the prompt of its first reply."""
    import numpy as np

    from dspark.data.prepare import PreparedData

    data = PreparedData(prepared)
    out = []
    for i in range(n):
        ids, mask = data.sample(i)
        out.append([int(t) for t in ids[: int(np.argmax(mask > 0))]])
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
