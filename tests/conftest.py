"""Shared fixtures: one tiny pre-trained verifier, prepared demo data and a store per session."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2-core CI boxes: more threads make tiny steps slower
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: fail fast instead of retrying
os.environ.setdefault("LOGURU_LEVEL", "ERROR")

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.toy import ToySpec, build_toy_verifier, demo_chat_path

LAYERS = [1, 3, 5]


def run_cli(*args, check=True, **kw) -> subprocess.CompletedProcess:
    """Run `dspark` in a child process, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", *map(str, args)],
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"dspark {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


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
    from dspark.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("prepared") / "demo"
    prepare(PrepareConfig(model=str(verifier), data=str(chat_file), output=str(out), seq_length=256,
                          minimum_valid_tokens=8), progress=False)
    return out


@pytest.fixture(scope="session")
def store(verifier, prepared, tmp_path_factory) -> Path:
    from dspark.extract.runner import ExtractConfig, run_extract

    out = tmp_path_factory.mktemp("stores") / "demo"
    run_extract(ExtractConfig(model=str(verifier), data=str(prepared), store=str(out),
                              target_layer_ids=LAYERS, batch_tokens=1024), progress=False)
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
