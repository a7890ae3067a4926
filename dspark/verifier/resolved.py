"""The verifier a command names, resolved once where the command starts and passed down: `Verifier`.

One object holds the local folder (a hub id found in the Hugging Face cache becomes its snapshot), what was
read of its config.json (`info`), its content hashes (computed at first use, then kept: hashing the weights
costs a read of the checkpoint) and the checks before it is built. The stages below take it instead of a
path they would resolve, read and hash again each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from dspark.verifier.check import check_verifier_config
from dspark.verifier.fingerprint import model_config_hash, tokenizer_hash, weights_hash
from dspark.verifier.hub import local_model, model_name
from dspark.verifier.info import FOLDER_FIX, VerifierInfo


@dataclass(frozen=True, eq=False)
class Verifier:
    folder: Path
    info: VerifierInfo = field(repr=False)
    trust_remote_code: bool = False

    @classmethod
    def resolve(cls, name_or_path: str | Path | Verifier, *, trust_remote_code: bool = False,
                noun: str = "model folder", fix: str = FOLDER_FIX) -> Verifier:
        """A local folder or a cached hub id, its config.json read; `noun` and `fix` word the error when the
        folder has none (each command names its own flag). A Verifier passes through as it is."""
        if isinstance(name_or_path, Verifier):
            return name_or_path
        folder = local_model(name_or_path)
        return cls(folder, VerifierInfo.load(folder, noun=noun, fix=fix), trust_remote_code)

    def __str__(self) -> str:
        return str(self.folder)

    def __fspath__(self) -> str:
        return str(self.folder)

    @property
    def name(self) -> str:
        """What stores and manifests call it (a cached snapshot's folder is a commit hash, not a name)."""
        return model_name(self.folder)

    @cached_property
    def tokenizer_hash(self) -> str:
        return tokenizer_hash(self.folder)

    @cached_property
    def config_hash(self) -> str:
        return model_config_hash(self.info)

    @cached_property
    def weights_hash(self) -> str:
        return weights_hash(self.folder)

    def check(self, dtype: str | None = None, host_memory: bool = True) -> Verifier:
        """Refuse, in one line naming the field, a verifier that cannot be built here (check.py says what)."""
        check_verifier_config(self.info, dtype, host_memory)
        return self

    def check_layer_ids(self, layer_ids: list[int]) -> list[int]:
        return self.info.check_layer_ids(layer_ids)
