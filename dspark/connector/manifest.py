"""The hidden-state store manifest: the one schema every sink and source shares."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from dspark import __version__
from dspark.errors import StoreError, StoreMismatch

FORMAT_VERSION = 1
Encoding = Literal["raw", "fp8_e4m3"]

# Fields that must agree between a store and the extraction (or training) that uses it.
IDENTITY_FIELDS = ("format_version", "verifier_config_hash", "tokenizer_hash", "target_layer_ids",
                   "hidden_size", "dtype", "encoding", "prepared_fingerprint")


class Codec(BaseModel):
    """Blosc (a standard zarr v3 codec) settings; chosen by measurement, see README."""

    model_config = ConfigDict(frozen=True)
    cname: str = "zstd"
    clevel: int = 1
    shuffle: Literal["noshuffle", "shuffle", "bitshuffle"] = "shuffle"
    blocksize: int = 1 << 20


class StoreManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    format_version: int = FORMAT_VERSION
    verifier_name: str
    verifier_config_hash: str
    tokenizer_hash: str
    target_layer_ids: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: Literal["bfloat16", "float16", "float32"]
    encoding: Encoding = "raw"
    codec: Codec = Codec()
    chunk_tokens: int
    prepared_fingerprint: str
    dspark_version: str = __version__
    created_at: str = ""

    @property
    def captured_layer_ids(self) -> list[int]:
        """Target layers, then the last layer (pre-norm): the store's layer axis."""
        return [*self.target_layer_ids, self.num_hidden_layers]

    def mismatches(self, other: StoreManifest) -> list[str]:
        return [f"{k}: store has {getattr(self, k)!r}, wanted {getattr(other, k)!r}"
                for k in IDENTITY_FIELDS if getattr(self, k) != getattr(other, k)]

    # --- persistence -------------------------------------------------------
    @classmethod
    def load(cls, root: Path) -> StoreManifest:
        path = root / "manifest.json"
        if not path.exists():
            raise StoreError(f"{root} is not a dspark store (no manifest.json)",
                             "point --store at a folder written by `dspark extract --to zarr`")
        data = json.loads(path.read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise StoreMismatch(f"store {root} has format version {data.get('format_version')}, "
                                f"this dspark reads {FORMAT_VERSION}",
                                "re-extract into a new store with this dspark version")
        return cls.model_validate(data)

    def create_or_match(self, root: Path) -> StoreManifest:
        """Write the manifest unless one exists; then require it to match this one.

        Creation is exclusive (link of a temp file), so concurrent writers agree on one.
        """
        root.mkdir(parents=True, exist_ok=True)
        path = root / "manifest.json"
        if not path.exists():
            stamped = self.model_copy(update={"created_at": datetime.now(timezone.utc).isoformat()})
            tmp = root / f".manifest.{uuid.uuid4().hex}.tmp"
            tmp.write_text(stamped.model_dump_json(indent=2))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        existing = StoreManifest.load(root)
        diffs = existing.mismatches(self)
        if diffs:
            raise StoreMismatch(f"store {root} was written for other inputs: " + "; ".join(diffs),
                                "use a new --store folder, or the model/layers/data it was made from")
        return existing
