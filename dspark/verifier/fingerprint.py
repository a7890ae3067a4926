"""Content hashes that tie stores, prepared data and runs to their inputs."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import xxhash

from dspark.core.errors import InputError
from dspark.core.files import FileRefused, file_xxh3
from dspark.verifier.info import VerifierInfo

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what transformers loads a model's weights from
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


def model_config_hash(model: Path | VerifierInfo) -> str:
    """Hash of the architecture-defining config (not weights: those are too big to hash each run).

    `model`: the verifier's folder, or what was read of it (its whole config.json is hashed)."""
    info = model if isinstance(model, VerifierInfo) else VerifierInfo.load(model)
    volatile = ("transformers_version", "_name_or_path", "architectures_version")
    return sha256_json({k: v for k, v in info.raw.items() if k not in volatile})


def weights_hash(model_dir: Path) -> str:
    """Hash of the weight files: each one's name, size and every byte (xxh3-128, streamed).

    Every byte, not the safetensors headers and sizes: a fine-tune of the same model has the
    same header (tensor names, dtypes, shapes, offsets) and the same size, and only its bytes
    tell it from its base. xxh3 runs well above disk speed, so this costs about one read of
    the checkpoint (the page cache often has it: extraction loads the same files); a file's
    digest is kept per process while its inode, size and mtime stay the same.
    """
    h = xxhash.xxh3_128()
    for p in sorted({p for pattern in WEIGHT_FILES for p in Path(model_dir).glob(pattern)}):
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{_file_xxh3(str(p), st.st_ino, st.st_size, st.st_mtime_ns)}\0".encode())
    return f"xxh3-128:{h.hexdigest()}"


@lru_cache(maxsize=256)
def _file_xxh3(path: str, ino: int, size: int, mtime_ns: int) -> str:
    """xxh3-128 of the file; `ino`, `size` and `mtime_ns` are only the memo's key (a rewritten file is hashed again)."""
    try:
        return file_xxh3(path)
    except FileRefused as e:
        raise InputError(f"verifier weight file {path} {e}",
                         "use a verifier folder whose weight files are regular files") from None
