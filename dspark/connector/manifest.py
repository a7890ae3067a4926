"""The hidden-state store manifest: the one schema every sink and source shares."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspark import __version__
from dspark.core.codec import CODECS, DEFAULT_CODEC
from dspark.connector.checksum import Kind as ChecksumKind
from dspark.connector.encoding import bytes_per_token
from dspark.core.errors import InputError, StoreError, StoreMismatch
from dspark.core.files import FileRefused, read_bounded
from dspark.core.fsio import write_new
from dspark.verifier.hub import model_name
from dspark.verifier.resolved import Verifier

FORMAT_VERSION = 1
MANIFEST_BYTES = 1 << 20  # the most a manifest.json may hold (one is ~1 KB): a bigger one is not read
Encoding = Literal["raw", "fp8_e4m3"]

# Fields that must agree between a store and the extraction (or training) that uses it. The
# verifier's weights must too, when the store records them: see `weights_differ`.
IDENTITY_FIELDS = ("format_version", "verifier_config_hash", "tokenizer_hash", "target_layer_ids",
                   "hidden_size", "dtype", "encoding", "prepared_fingerprint")


class Codec(BaseModel):
    """Blosc (a standard zarr v3 codec) settings; chosen by measurement, see docs/performance.md."""

    model_config = ConfigDict(frozen=True)
    cname: str = "zstd"
    clevel: int = 1
    shuffle: Literal["noshuffle", "shuffle", "bitshuffle"] = "shuffle"
    blocksize: int = 1 << 20

    @property
    def name(self) -> str:
        """Its name in CODECS (`extract --codec`), or its settings where no name gives them."""
        return next((k for k, v in CODECS.items() if v == self.model_dump()),
                    f"{self.cname}-{self.clevel}-{self.shuffle}")


def codec_named(name: str | None) -> Codec:
    if name is None:
        name = DEFAULT_CODEC
    if name not in CODECS:
        raise InputError(f"unknown codec {name!r}", f"use one of {', '.join(CODECS)}")
    return Codec(**CODECS[name])


class StoreManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    format_version: int = FORMAT_VERSION
    verifier_name: str
    verifier_config_hash: str
    tokenizer_hash: str
    # Stores written before weights were recorded have none: they stay readable, and cannot tell.
    verifier_weights_hash: str | None = None
    target_layer_ids: list[int]
    num_hidden_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    dtype: Literal["bfloat16", "float16", "float32"]
    encoding: Encoding = "raw"
    codec: Codec = Codec()
    checksum: ChecksumKind = "xxh3_64"  # load() reads a manifest without one as "crc32": stores from before
    chunk_tokens: int = Field(gt=0)
    prepared_fingerprint: str
    dspark_version: str = __version__
    created_at: str = ""

    @property
    def captured_layer_ids(self) -> list[int]:
        """Target layers, then the last layer (pre-norm): the store's layer axis."""
        return [*self.target_layer_ids, self.num_hidden_layers]

    def mismatches(self, other: StoreManifest, accept_other_weights: bool = False) -> list[str]:
        out = [f"{k}: store has {getattr(self, k)!r}, wanted {getattr(other, k)!r}"
               for k in IDENTITY_FIELDS if getattr(self, k) != getattr(other, k)]
        if weights_differ(self.verifier_weights_hash, other.verifier_weights_hash) and not accept_other_weights:
            out.append(f"verifier weights: store has {self.verifier_weights_hash}, wanted "
                       f"{other.verifier_weights_hash} (--accept-other-weights adds states of other weights knowingly)")
        return out

    def require_match(self, where: str, fix: str, expected: StoreManifest | None = None, *,
                      verifier: Verifier | None = None, accept_other_weights: bool = False, **wanted) -> bool:
        """The one identity check of a store (extract, train, verify, repair): StoreMismatch naming every field
        that differs from `expected` (a writer's whole identity) or from `wanted` (the fields a reader knows,
        e.g. prepared_fingerprint). `verifier`: a model whose weights must be the store's, named in the error.
        Returns whether the store holds other weights than wanted, accepted by `accept_other_weights`.
        """
        if verifier is not None:
            wanted["verifier_weights_hash"] = verifier.weights_hash
        expected = expected or self.model_copy(update=wanted)
        named = verifier is not None and weights_differ(self.verifier_weights_hash, expected.verifier_weights_hash)
        diffs = self.mismatches(expected, accept_other_weights or named)
        if diffs:
            raise StoreMismatch(f"store {where} was written for other inputs: " + "; ".join(diffs), fix)
        if named and not accept_other_weights:
            raise StoreMismatch(f"store {where} was extracted with other verifier weights than {verifier} "
                                f"(store {self.verifier_weights_hash}, verifier {expected.verifier_weights_hash})",
                                "use the verifier the store was extracted with, or pass --accept-other-weights to "
                                "mix in this one's states knowingly (the store's segments and the run record it)")
        return weights_differ(self.verifier_weights_hash, expected.verifier_weights_hash)

    # --- persistence -------------------------------------------------------
    @classmethod
    def load(cls, root: Path) -> StoreManifest:
        path = root / "manifest.json"
        if not path.exists():
            raise StoreError(f"{root} is not a dspark store (no manifest.json)",
                             "point --store at a folder written by `dspark extract --to zarr`")
        fix = "restore manifest.json from a copy of the store (it is written once, when the store is created)"
        try:
            data = json.loads(read_bounded(path, MANIFEST_BYTES))
        except FileRefused as e:
            raise StoreError(f"{path} {e}", fix) from None
        except OSError as e:
            raise StoreError(f"{path} cannot be read ({e.strerror or e})", fix) from None
        except ValueError as e:  # not UTF-8, or not JSON
            raise StoreError(f"store {root} has a damaged manifest.json: it is not JSON ({e})", fix) from None
        if not isinstance(data, dict):
            raise StoreError(f"store {root} has a damaged manifest.json: it is not a JSON object", fix)
        data.setdefault("checksum", "crc32")  # written before stores named their checksum
        if data.get("format_version") != FORMAT_VERSION:
            raise StoreMismatch(f"store {root} has format version {data.get('format_version')}, "
                                f"this dspark reads {FORMAT_VERSION}",
                                "re-extract into a new store with this dspark version")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise StoreError(f"store {root} has a damaged manifest.json: "
                             + "; ".join(map(_field_problem, e.errors())), fix) from None

    def create_or_match(self, root: Path, accept_other_weights: bool = False) -> StoreManifest:
        """Write the manifest unless one exists; then require it to match this one.

        Creation is exclusive (link of a temp file), so concurrent writers agree on one. A new
        store goes only into a new or empty folder: a folder of other files is never taken over.
        """
        root.mkdir(parents=True, exist_ok=True)
        path = root / "manifest.json"
        if not path.exists():
            # Ignored: a concurrent creator's temp manifest (fsio's `.manifest.json.*.tmp`, `.manifest.*.tmp` of
            # dspark before it), and the lost+found of a fresh filesystem.
            # A creator links manifest.json before writing anything else, hence the second look.
            others = sorted(p.name for p in root.iterdir()
                            if not (p.name.startswith(".manifest.") and p.name.endswith(".tmp"))
                            and p.name not in ("lost+found", "manifest.json"))
            if others and not path.exists():
                raise StoreError(f"{root} is not empty and is not a dspark store (no manifest.json; it holds "
                                 f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''})",
                                 "use a new or empty folder for a new store, or the folder of an existing store")
            stamped = self.model_copy(update={"created_at": datetime.now(timezone.utc).isoformat()})
            write_new(path, stamped.model_dump_json(indent=2))  # loses to a concurrent creator's: matched below
        existing = StoreManifest.load(root)
        existing.require_match(str(root), "use a new --store folder, or the model/layers/data it was made from", self,
                               accept_other_weights=accept_other_weights)
        return existing


def _field_problem(err: dict) -> str:
    """One pydantic error as `field: what is wrong (got value)`: the allowed values are in pydantic's message."""
    where = ".".join(map(str, err["loc"]))
    if err["type"] == "missing":
        return f"{where}: Field required"
    return f"{where}: {err['msg']} (got {err['input']!r:.60})"


def weights_differ(stored: str | None, wanted: str | None) -> bool:
    """Whether two weight hashes tell of other weights; an unknown one (a store from before) tells nothing."""
    return stored is not None and wanted is not None and stored != wanted


def default_store(model: str | Path, target_layer_ids: list[int], prepared_fingerprint: str) -> str:
    """Where a store lives when no --store/--cache is given: named by what makes its identity,
    so `dspark extract` and `dspark train` find the same folder without being told."""
    layers = "-".join(map(str, target_layer_ids))
    return str(Path("cache") / "stores" / f"{model_name(model)}-L{layers}-{prepared_fingerprint[:12]}")


def default_chunk_tokens(token_bytes: int, target_bytes: int = 1 << 20) -> int:
    """Power-of-two token count giving ~1 MiB chunks (smaller chunks compress worse)."""
    tokens = max(1, target_bytes // token_bytes)
    return int(min(4096, max(16, 1 << (tokens.bit_length() - 1))))


def manifest_for_model(verifier: Verifier, target_layer_ids: list[int], prepared_fingerprint: str, *,
                       encoding: Encoding, chunk_tokens: int | None = None, verifier_name: str | None = None,
                       dtype: str | None = None, codec: str | None = None) -> StoreManifest:
    """The store identity for states of `verifier` at these layers over one prepared data set.

    Built from the model folder alone, so every producer (the transformers engine,
    `dspark serve`, a vLLM worker) and a trainer filling a cache agree on it byte for byte.
    The verifier keeps its hashes, so a producer serving many data sets hashes the weights once.
    """
    info = verifier.info
    layers = info.check_layer_ids(target_layer_ids)
    dtype = dtype or info.dtype or "float32"
    per_token = bytes_per_token(len(layers) + 1, info.hidden_size, encoding, dtype)
    return StoreManifest(
        verifier_name=verifier_name or model_name(verifier.folder.resolve()),
        verifier_config_hash=verifier.config_hash,
        tokenizer_hash=verifier.tokenizer_hash,
        verifier_weights_hash=verifier.weights_hash,
        target_layer_ids=layers,
        num_hidden_layers=info.num_hidden_layers,
        hidden_size=info.hidden_size,
        dtype=dtype,
        encoding=encoding,
        codec=codec_named(codec),
        chunk_tokens=chunk_tokens or default_chunk_tokens(per_token),
        prepared_fingerprint=prepared_fingerprint,
    )
