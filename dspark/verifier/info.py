"""What dspark knows of a verifier folder before building it: its config.json, read once, in one place.

Every command that needs a verifier's sizes (layer count, hidden size, vocabulary, dtype, context
length) reads them here instead of from its own copy of the file: the extraction engines, the store
manifest, the vLLM launcher, the trainer's store check, the config check and the fingerprint. The
read is bounded (a config.json may be a link to /dev/zero or a multi-GB mistake) and its failures are
`InputError`s that name the file. A multimodal verifier keeps its language model's settings under
`text_config`: `config` is that part, `raw` the whole file (what the fingerprint hashes).

The values are the file's, never a transformers class default: a size the file leaves out raises
when it is asked for instead of silently becoming 4096.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark.core.errors import InputError
from dspark.core.files import FileRefused, read_bounded

JSON_LIMIT = 64 << 20  # bytes read of config.json or a weight index: real ones are KBs to a few MBs
CONFIG_FIX = "correct config.json to match the model's weights, or download the model folder again"
FOLDER_FIX = "pass a local Hugging Face model folder"


def read_json_object(path: Path, fix: str = CONFIG_FIX) -> dict:
    """A JSON object from `path`, read up to `JSON_LIMIT` bytes (a path may name /dev/zero)."""
    try:
        data = json.loads(read_bounded(path, JSON_LIMIT))
    except (OSError, ValueError, FileRefused) as e:  # ValueError: also JSON, UTF-8 and integers of over 4300 digits
        raise InputError(f"{path} is unreadable ({' '.join(str(e).split())[:200]})", fix) from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object", fix)
    return data


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """`layer_ids` as a list, if each is a layer a verifier of `num_layers` layers has (0 = embeddings), once."""
    bad = [k for k in layer_ids if not 0 <= k <= num_layers]
    if bad or not layer_ids:
        raise InputError(f"target layer id(s) {bad or layer_ids} out of range for a verifier with "
                         f"{num_layers} layers", f"use ids in 0..{num_layers} (0 = embeddings)")
    if len(set(layer_ids)) != len(layer_ids):
        raise InputError(f"duplicate target layer ids {layer_ids}", "list each layer once")
    return list(layer_ids)


@dataclass(frozen=True)
class VerifierInfo:
    folder: Path
    raw: dict     # config.json as written
    config: dict  # the language model's settings: `raw`, or its text_config (multimodal verifiers)

    @classmethod
    def load(cls, folder: str | Path, *, noun: str = "model folder", fix: str = FOLDER_FIX) -> VerifierInfo:
        """`folder`'s config.json; `noun` and `fix` word the error when the folder has none (each command
        names its own flag)."""
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise InputError(f"{noun} {folder} has no config.json", fix)
        raw = read_json_object(path)
        return cls(folder, raw, raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw)

    @property
    def path(self) -> Path:
        return self.folder / "config.json"

    def size(self, name: str) -> int:
        """A size the file must give (`hidden_size`, ...) as a positive integer; one line naming it otherwise."""
        value = self.config.get(name)
        if value is None:
            raise InputError(f"{self.path} has no {name}", "pass a causal LM's folder")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{self.path}: {name} {json.dumps(value)} is not a positive integer", CONFIG_FIX)
        return value

    @property
    def num_hidden_layers(self) -> int:
        return self.size("num_hidden_layers")

    @property
    def hidden_size(self) -> int:
        return self.size("hidden_size")

    @property
    def vocab_size(self) -> int:
        return self.size("vocab_size")

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest sequence it was trained on; None when the file does not say."""
        value = self.config.get("max_position_embeddings")
        return None if value is None else self.size("max_position_embeddings")

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def dtype(self) -> str | None:
        """The dtype the language model's settings name (`dtype`, or `torch_dtype` before transformers 4.56),
        without a `torch.` prefix; None when they name none. As transformers reads a multimodal config, a
        dtype given only beside text_config is not the language model's."""
        value = self.config.get("dtype") or self.config.get("torch_dtype")
        return None if value is None else str(value).removeprefix("torch.")

    @property
    def weights_dtype(self) -> str | None:
        """The dtype the folder's weights are declared in: the file's own (a multimodal config keeps it beside
        text_config), else the language model's; None when neither names one."""
        value = self.raw.get("dtype") or self.raw.get("torch_dtype")
        return self.dtype if value is None else str(value).removeprefix("torch.")

    def check_layer_ids(self, layer_ids: list[int]) -> list[int]:
        """`layer_ids` as a list, if each is one of this verifier's layers (0 = embeddings), once."""
        return check_layer_ids(layer_ids, self.num_hidden_layers)
