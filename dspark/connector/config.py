"""The connector's settings: where samples go (SinkConfig), each backend's own (ZarrConfig, MooncakeConfig), live reads.

A vLLM worker process builds its sinks from `kv_connector_extra_config` (SinkConfig as JSON)
plus what vLLM already knows (model, dtype, layer ids), so it needs nothing else of dspark's
pipeline. Torch-free: the command line builds its options from these classes at start-up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

from dspark.core.codec import CODECS, DEFAULT_CODEC
from dspark.core.errors import InputError
from dspark.connector.registry import BACKENDS, SINKS
from dspark.core.settings import build, setting


MASTER_PORT = 50051  # Mooncake's own default


@dataclass
class MasterConfig:
    """`dspark mooncake-master`: the Mooncake master, the metadata service every live process dials."""

    port: int = setting(MASTER_PORT, "RPC port: the clients' --mooncake-master HOST:PORT.", ge=1)
    metrics_port: int = setting(9003, "HTTP metrics port.", ge=1)
    rpc_threads: int = setting(8, "RPC worker threads.", ge=1)
    print_only: bool = setting(False, "Print the master's command line and exit.", negatable=False)

    def argv(self) -> list[str]:
        """mooncake_master's flags. No disk eviction: a sample lives in memory until it is read or expires."""
        return ["--rpc_port", str(self.port), "--metrics_port", str(self.metrics_port),
                "--rpc_thread_num", str(self.rpc_threads), "--enable_disk_eviction=false", "--logtostderr=true"]


@dataclass
class MooncakeConfig:
    """The seed's Mooncake flags (`--mooncake-*`)."""

    master: str = setting(f"127.0.0.1:{MASTER_PORT}", "Mooncake master address.")
    metadata_server: str = setting("P2PHANDSHAKE", "Transfer-engine metadata server.")
    protocol: Literal["tcp", "rdma"] = setting("tcp", "Transport.")
    device: str = setting("", "RDMA device name(s).")
    global_segment_gib: float = setting(
        1.0, "Memory this process contributes to the store (0 for a pure consumer).", ge=0)
    local_buffer_gib: float = setting(0.5, "Registered staging memory.", gt=0)
    writer_threads: int = setting(2, "Puts in flight (they overlap the next forward).", ge=1)
    local_hostname: str = setting("127.0.0.1", "Address the other nodes reach this process at (its node's name or "
                                               "IP when the master, extractor and trainer run on different nodes).")
    put_timeout: float = setting(60.0, "How long a producer waits for space (back-pressure) before failing.",
                                 cli=False, gt=0)
    # Objects live in the memory their writers mount: a producer that mounted a segment
    # waits this long at exit for consumers to read what it published.
    linger_seconds: float = setting(
        600.0, "A producer that mounts memory waits this long at exit for consumers.", ge=0)


@dataclass
class LiveConfig:
    """How a live run (`--from mooncake`) gets the samples its cache lacks."""

    endpoint: str | None = setting(
        None, "Extraction server (vLLM + our connector, or `dspark serve`), e.g. http://host:8000/v1. "
              "Without it a live run waits for a producer (`dspark extract --to mooncake`).",
        flags=("--vllm-endpoint",))
    on_missing: Literal["generate", "skip", "warn", "raise"] = setting(
        "generate", "A sample not in the cache: fetch it live, or skip/warn/fail.")
    on_generate: Literal["keep", "delete"] = setting("keep", "delete: free it from Mooncake once cached.")
    request_timeout: float = setting(60.0, "Seconds per extraction request (a busy vLLM may take long).", gt=0)
    # A hung server (stopped, wedged) still accepts connections, so only a liveness check tells it from a slow one.
    stall_timeout: float = setting(
        10.0, "Seconds a hung extraction server may hold up live reads: a reply slower than half of it makes the "
              "server answer GET /health within the other half, else the live source is down at once.", gt=0)
    max_retries: int = setting(3, "Retries of a failed request.", ge=0)
    generation_validation_retries: int = setting(
        2, "Requests again when the returned tokens or values are wrong.", ge=0)
    max_consecutive_generation_failures: int = setting(
        8, "Failed requests in a row to a server that answers its liveness check, then training stops with a "
           "clear error (a server that does not answer is waited for: --max-down-seconds).", ge=1)
    # Time, not a count: a dead server fails in milliseconds, and a vLLM restart takes minutes.
    max_down_seconds: float = setting(
        600.0, "How long the extraction server may stay down (unreachable or hung) before the run stops; "
               "meanwhile training continues on cached samples, and the skipped ones are named in the run record.",
        gt=0)
    mooncake: MooncakeConfig = setting(factory=MooncakeConfig)


Codec = Literal[tuple(CODECS)]
ACCEPT_OTHER_WEIGHTS = ("Write into a store extracted with a verifier of other weights (same config): its new "
                        "segment records them, and `dspark store info` lists it.")


@dataclass
class ZarrConfig:
    """The Zarr store a sink writes into (`--store`, `--codec`, `--chunk-tokens`): the settings of Zarr alone."""

    store: str | None = setting(None, "Zarr store folder (created or resumed); default with `dspark extract`: "
                                      "cache/stores/<verifier>-L<layers>-<data>, where `dspark train` looks for it.")
    codec: Codec | None = setting(
        None, f"Zarr compression of a new store (default: {DEFAULT_CODEC}, the smallest; lz4 reads faster and "
              "stores larger: docs/performance.md). An existing store keeps its own.")
    chunk_tokens: int | None = setting(None, "Tokens per chunk (default: ~1 MiB chunks).", ge=1)
    rewrite: list[int] = setting(factory=list, cli=False)  # ids stored damaged: written again (a repair)
    # what the engine that extracts is (vLLM's version and model runner): recorded on each segment it writes
    segment_attrs: dict[str, str] = setting(factory=dict, cli=False)
    accept_other_weights: bool = setting(False, ACCEPT_OTHER_WEIGHTS, negatable=False)

    def existing_manifest(self):
        """The manifest of the store in `store`, if there is one; refused if --codec names another codec than
        the one it was created with (a store keeps it: the sink writes in the store's codec, whatever --codec says)."""
        from dspark.connector.manifest import StoreManifest, codec_named

        if not (self.store and (Path(self.store) / "manifest.json").exists()):
            return None
        existing = StoreManifest.load(Path(self.store))
        if self.codec and existing.codec != codec_named(self.codec):
            raise InputError(f"store {self.store} was created with codec {existing.codec.name}, not {self.codec}: "
                             "a store keeps the codec it was created with",
                             f"drop --codec to extend it, or pass a new --store for {self.codec}")
        return existing


@dataclass
class SinkConfig:
    """Where extracted samples go: `dspark extract`'s and `dspark serve`'s sink flags, and vLLM's extra config.

    `to` names the sinks; each backend's own settings sit under its name (`zarr`, `mooncake`: one field per
    registered backend), and the rest is the store identity every sink shares (the manifest).
    """

    to: str = setting("zarr", "Sink(s): zarr, mooncake or zarr,mooncake (--hidden-states-backend is the seed's "
                              "name).", flags=("--to", "--hidden-states-backend"))
    zarr: ZarrConfig = setting(factory=ZarrConfig, prefixed=False)  # the seed's names: --store, not --zarr-store
    # Pins the store identity to one prepared data set. Live requests carry their own in
    # kv_transfer_params, so a Mooncake-only server serves any data set of its verifier.
    prepared_fingerprint: str | None = setting(None, cli=False)
    verifier_name: str | None = setting(None, "Name recorded in the manifest (default: folder name).")
    encoding: Literal["raw", "fp8_e4m3"] = setting(
        "raw", "Store fp8 e4m3 with a scale per token and layer (half of bf16).", flags=("--fp8",), switch="fp8_e4m3")
    # The vLLM connector flushes its sinks this often: the longest a finished sample waits in a partial Zarr chunk.
    flush_interval_s: float = setting(0.5, cli=False)
    mooncake: MooncakeConfig = setting(factory=MooncakeConfig)

    def __post_init__(self):
        SINKS.parse(self.to)  # before a launcher hands an unknown name to vLLM's workers

    @property
    def _offline(self) -> str | None:
        """The name of the offline sink `to` names (the one writing into a store folder), or None."""
        return next((n for n in SINKS.parse(self.to) if BACKENDS[n].offline), None)

    @property
    def _at_rest(self):
        """The config of the offline sink `to` names, or None."""
        return getattr(self, self._offline) if self._offline else None

    @property
    def needs_store(self) -> bool:
        """An offline sink writes into a store folder, bound to one prepared data set."""
        return self._at_rest is not None

    @property
    def store(self) -> str | None:
        """The store folder the offline sink writes into (None: no such sink, or not given yet)."""
        return self._at_rest.store if self.needs_store else None

    @property
    def accept_other_weights(self) -> bool:
        return bool(self.needs_store and self._at_rest.accept_other_weights)

    def with_store(self, store: str | None) -> SinkConfig:
        """These sinks, the offline one writing into `store`."""
        if not self.needs_store:
            return self
        return replace(self, **{self._offline: replace(self._at_rest, store=store)})

    def require_store(self, data: str | None) -> None:
        """An offline sink needs its store folder and the prepared data it holds (the store's identity)."""
        if self.needs_store and not (self.store and data):
            raise InputError("writing to a Zarr store needs --store and --data (the prepared folder it holds)",
                             "pass both, or use --to mooncake")

    def existing_manifest(self):
        """The manifest of the store the offline sink writes into, if one exists (its own checks applied)."""
        return self._at_rest.existing_manifest() if self.needs_store else None

    def open_store(self):
        """The store the offline sink writes into, read back as it is now (None: no such sink, or no store yet)."""
        from dspark.connector.base import open_store

        if not (self.needs_store and self.store and (Path(self.store) / "manifest.json").exists()):
            return None
        return open_store(self.store, self._offline)

    @property
    def writer_threads(self) -> int:
        """The connector's writer pool (its writes overlap the next forward): as many as Mooncake puts in flight."""
        return self.mooncake.writer_threads

    def for_data(self, prepared_fingerprint: str | None, rewrite=()) -> SinkConfig:
        """These sinks bound to one prepared data set, writing the stored copies of `rewrite` again."""
        return replace(self, prepared_fingerprint=prepared_fingerprint,
                       zarr=replace(self.zarr, rewrite=sorted(rewrite)))

    def recording(self, attrs: dict[str, str]) -> SinkConfig:
        """These sinks, recording `attrs` (what the extracting engine is) on what they store (a Zarr segment's)."""
        return replace(self, zarr=replace(self.zarr, segment_attrs=dict(attrs)))

    @classmethod
    def rewriting(cls, store: str, manifest, accept_other_weights: bool = False) -> SinkConfig:
        """The sink that writes into the existing store `store` (of `manifest`) again, in its own layout: a repair."""
        return cls(to="zarr", verifier_name=manifest.verifier_name, encoding=manifest.encoding,
                   zarr=ZarrConfig(store=store, chunk_tokens=manifest.chunk_tokens,
                                   accept_other_weights=accept_other_weights))

    def manifest(self, verifier, target_layer_ids: list[int], prepared_fingerprint: str, dtype: str | None):
        """The store identity these sinks write samples of `verifier` (resolved) under (manifest.py's
        `manifest_for_model`)."""
        from dspark.connector.manifest import manifest_for_model

        return manifest_for_model(verifier, target_layer_ids, prepared_fingerprint, encoding=self.encoding,
                                  chunk_tokens=self.zarr.chunk_tokens, verifier_name=self.verifier_name, dtype=dtype,
                                  codec=self.zarr.codec)

    def open(self, manifest):
        """The one sink factory: the sinks `to` names, for samples of `manifest` (a tee when several); each
        backend's factory gets its own config, under its name."""
        from dspark.connector.base import open_sink  # the backends load at first use, not with the settings

        return open_sink(self.to, manifest=manifest, **{name: getattr(self, name) for name in BACKENDS})

    def to_extra_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_extra_config(cls, extra: dict) -> SinkConfig:
        """What `to_extra_config` wrote (nested per backend); an unknown key, at any depth, is one line."""
        if not isinstance(extra, dict):
            raise InputError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}",
                             f"pass SinkConfig's settings: {sorted(f.name for f in fields(cls))}")
        return build(cls, extra, "kv_connector_extra_config")


@dataclass
class StorePath:
    """A Zarr store folder, as `dspark store` commands take it."""

    path: str = setting(help="The store folder.", positional=True)


@dataclass
class StoreCheck(StorePath):
    """`dspark store verify`: the store, and optionally the prepared data it should hold all of."""

    data: str | None = setting(
        None, "The prepared folder the store was extracted from: also find the samples the store lacks.")
