"""Settings of extraction: a run over prepared data (`dspark extract`) and a server (`dspark serve`).

Torch-free: the command line builds its options from these classes at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dspark.connector.config import ACCEPT_OTHER_WEIGHTS, SinkConfig
from dspark.core.registry import Registry
from dspark.core.settings import check_settings, setting

# name -> "module:Class", imported only when chosen: the vLLM engine's module loads for `--engine vllm` alone,
# and the engines import Engine from base.py without either importing them back (no cycle)
ENGINES = Registry("engine", "--engine", {
    "transformers": "dspark.extract.transformers_engine:TransformersEngine",
    "vllm": "dspark.extract.vllm_engine:VllmEngine"})


@dataclass(frozen=True)
class ServeLimits:
    """What one bad client of `dspark serve` may cost: a bounded wait, never a hung thread."""

    max_model_len: int | None = setting(
        None, "Longest prompt in tokens; longer ones get a 400. Default and most: the verifier's "
              "max_position_embeddings (positions past it were never trained).", ge=1)
    client_timeout: float = setting(30.0, "Seconds a connection has to send its request, then it gets a 408 and "
                                          "is closed; also bounds each reply write.", gt=0)
    max_connections: int = setting(64, "Connections served at once, one thread each (forwards run one at a time "
                                       "anyway); more get a 503 at once.", ge=1)

    def __post_init__(self):
        check_settings(self)


def server_sinks() -> SinkConfig:
    """A server's samples go live by default: a trainer reading --from mooncake asks for them."""
    return SinkConfig(to="mooncake")


@dataclass(kw_only=True)
class VerifierRun:
    """The verifier a command runs, and where."""

    model: str = setting(help="Verifier folder, or a hub id in the Hugging Face cache.")
    device: str = setting("cpu")
    trust_remote_code: bool = setting(False, negatable=False)


@dataclass(kw_only=True)
class Batching(VerifierRun):
    """How prepared samples are batched into forwards: the same batches give byte-identical states."""

    batch_tokens: int = setting(8192, "Padded tokens per forward.", ge=1)
    max_batch_size: int = setting(64, ge=1)


@dataclass(kw_only=True)
class ExtractConfig(Batching):
    """`dspark extract`: capture verifier hidden states of prepared samples into the sinks."""

    data: str = setting(help="A folder written by `dspark prepare`.")
    target_layer_ids: list[int] = setting(help="e.g. `1 3 5` or `1,3,5`.", distinct=True)
    engine: Literal[ENGINES.choices()] = setting(
        "transformers", "vllm: vllm.LLM with our KV connector (run from .venv-vllm).")
    dtype: str | None = setting(None, "Override the verifier dtype (default: its config's).")
    shard: str = setting("0/1", "INDEX/COUNT: this writer's share of batches.")
    prefix_caching: bool = setting(True, "vllm engine: compute shared prompt prefixes once.")
    tensor_parallel_size: int = setting(
        1, "vllm engine: devices one extraction process spans (one shard per node: see --shard).", ge=1)
    sink: SinkConfig = setting(factory=SinkConfig, prefixed=False)


@dataclass(kw_only=True)
class ServeConfig(VerifierRun):
    """`dspark serve`: an OpenAI-compatible extraction server (the CPU/test stand-in for vLLM + our connector)."""

    host: str = setting("127.0.0.1")
    port: int = setting(8000, ge=0)
    data: str | None = setting(
        None, "Prepared data: pins the store identity (needed with zarr; live requests name their own).")
    target_layer_ids: list[int] = setting(help="e.g. `1 3 5` or `1,3,5`.", distinct=True)
    dtype: str | None = setting(None, "Override the verifier dtype (default: its config's).")
    limits: ServeLimits = setting(factory=ServeLimits, prefixed=False)
    sink: SinkConfig = setting(factory=server_sinks, prefixed=False)

    def __post_init__(self):
        self.sink.require_store(self.data)


@dataclass(kw_only=True)
class LaunchConfig:
    """`dspark launch-vllm` (scripts/launch_vllm.py): vLLM as the extractor, from the seed's command line."""

    model: str = setting(help="Verifier: a local folder or a hub id (its config.json is read from the Hugging Face "
                              "cache, or vLLM's --download-dir; not cached: pass --num-hidden-layers).",
                         positional=True)
    data: str | None = setting(None, "Prepared folder: pins the store identity (needed with zarr).")
    target_layer_ids: list[int] = setting(help="e.g. `24 48 72` or `24,48,72`.", distinct=True)
    num_hidden_layers: int | None = setting(None, "Only when MODEL is neither a folder nor cached.", ge=1)
    trust_remote_code: bool = setting(False, negatable=False)
    python: str | None = setting(None, "Interpreter with vLLM (default: this one).")
    host: str | None = setting(None, "vLLM's --host, also accepted after `--` (default: vLLM's, every interface).")
    port: int | None = setting(None, "vLLM's --port, also accepted after `--` (default 8000).", ge=0)
    health_timeout: float = setting(1800.0, "Seconds to wait for /health.", gt=0)
    print_only: bool = setting(False, "Print the command, env and configs as JSON.", negatable=False)
    # A deployment's vLLM flags (configs/*.yaml); the command line's, after `--`, come after them and win.
    vllm_args: list[str] = setting(factory=list, cli=False)
    sink: SinkConfig = setting(factory=server_sinks, prefixed=False)

    def __post_init__(self):
        self.sink.require_store(self.data)


@dataclass(kw_only=True)
class RepairConfig(Batching):
    """`dspark store repair`: re-extract exactly a store's damaged and missing samples."""

    store: str = setting(help="The store to repair.", positional=True)
    data: str = setting(help="The prepared folder the store was extracted from.")
    accept_other_weights: bool = setting(False, ACCEPT_OTHER_WEIGHTS, negatable=False)
