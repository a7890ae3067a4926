"""Content hashes that tie stores, prepared data and runs to their inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def sha256_files(paths: list[Path], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_hash(model_dir: Path) -> str:
    return sha256_files([model_dir / n for n in TOKENIZER_FILES if (model_dir / n).exists()])


def model_config_hash(model_dir: Path) -> str:
    """Hash of the architecture-defining config (not weights: those are too big to hash each run)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path", "architectures_version"):
        cfg.pop(volatile, None)
    return sha256_json(cfg)
