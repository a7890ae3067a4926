"""Where samples go: one config for every sink set, from a CLI or from vLLM's extra config alone.

A vLLM worker process builds its sinks from `kv_connector_extra_config` (this
dataclass as JSON) plus what vLLM already knows (model, dtype, layer ids), so it
needs nothing else of dspark's pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dspark.config import MooncakeConfig
from dspark.errors import InputError


@dataclass
class SinkConfig:
    to: str = "zarr"  # sink names, comma-separated: zarr, mooncake, zarr,mooncake
    store: str | None = None  # Zarr store folder (needed by the zarr sink)
    # Pins the store identity to one prepared data set. Live requests carry their own in
    # kv_transfer_params, so a Mooncake-only server serves any data set of its verifier.
    prepared_fingerprint: str | None = None
    verifier_name: str | None = None  # recorded in the manifest (default: the model folder's name)
    encoding: str = "raw"  # raw (lossless) | fp8_e4m3
    codec: str | None = None  # a name in dspark.codec.CODECS for a new Zarr store (default: zstd)
    chunk_tokens: int | None = None  # default: ~1 MiB chunks
    writer_threads: int = 4  # the connector's writer pool: writes overlap the next forward
    flush_interval_s: float = 0.5  # longest a finished sample waits in a partial Zarr chunk
    rewrite: list[int] = field(default_factory=list)  # ids stored damaged: written again (a repair)
    accept_other_weights: bool = False  # write into a store extracted with other verifier weights
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)

    def to_extra_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_extra_config(cls, extra: dict) -> SinkConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InputError(f"unknown dspark connector setting(s) {unknown}",
                             f"kv_connector_extra_config takes {sorted(known)}")
        mooncake = MooncakeConfig(**extra.get("mooncake", {}))
        return cls(**{**extra, "mooncake": mooncake})
