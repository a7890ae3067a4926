"""Commands that capture hidden states and look after stores: extract, serve, launch-vllm, mooncake-master, store."""

from __future__ import annotations

from dataclasses import replace

import click

from dspark.cli.app import Progress, command, echo_json, local, main
from dspark.connector.config import MasterConfig, StoreCheck, StorePath
from dspark.extract.config import ExtractConfig, RepairConfig, ServeConfig


@command(main, "extract", ExtractConfig, Progress, config_file=ExtractConfig)
def extract(cfg: ExtractConfig, shown: Progress):
    """Capture verifier hidden states into a Zarr store and/or Mooncake (resumable, crash-safe).

    --to mooncake streams each sample to the live store for a trainer reading with
    --from mooncake (producer-driven, with back-pressure); --to zarr,mooncake tees.
    """
    cfg = replace(cfg, model=local(cfg.model))  # a missing verifier: refused before the runner imports torch
    from dspark.extract.runner import run_extract

    echo_json(run_extract(cfg, progress=not shown.no_progress))


@command(main, "serve", ServeConfig)
def serve(cfg: ServeConfig):
    """OpenAI-compatible extraction server (the CPU/test stand-in for vLLM + our KV connector)."""
    from dspark.connector.producer import Producer
    from dspark.extract.serve import ExtractionService, make_server
    from dspark.extract.transformers_engine import TransformersEngine
    from dspark.verifier.hub import model_name
    from dspark.verifier.resolved import Verifier
    from dspark.data.prepare import PreparedData

    verifier = Verifier.resolve(cfg.model, trust_remote_code=cfg.trust_remote_code)
    model = verifier.folder
    engine = TransformersEngine(verifier, cfg.target_layer_ids, device=cfg.device, dtype=cfg.dtype,
                                trust_remote_code=cfg.trust_remote_code)
    sinks = cfg.sink.for_data(PreparedData(cfg.data).fingerprint if cfg.data else None)
    producer = Producer(sinks, verifier, cfg.target_layer_ids, engine.dtype_name)
    server = make_server(ExtractionService(engine, producer, model_name(model), cfg.limits), cfg.host, cfg.port)
    click.echo(f"dspark serve: {model} on http://{cfg.host}:{cfg.port}/v1 -> {cfg.sink.to}", err=True)
    try:
        server.serve_forever()
    finally:
        producer.close()


class _RawArgs(click.Command):
    """Hands the words after the command name over untouched: click would drop the `--` before vLLM's flags."""

    def parse_args(self, ctx, args):
        ctx.params["argv"] = list(args)
        return []


@main.command("launch-vllm", cls=_RawArgs, add_help_option=False)
def launch_vllm(argv):
    """Start vLLM with our KV connector: the seed's extraction flags, then `--` and vLLM's (see --help)."""
    from dspark.deployment import SECTIONS
    from dspark.extract.launch import main as launch

    launch(argv, SECTIONS)


@command(main, "mooncake-master", MasterConfig, config_file=MasterConfig)
def mooncake_master(cfg: MasterConfig):
    """Run the Mooncake master (live runs): this process becomes mooncake_master, so signals reach it."""
    import os
    import shlex

    from dspark.connector.mooncake.client import master_binary

    argv = [master_binary(), *cfg.argv()]
    if cfg.print_only:
        click.echo(shlex.join(argv))
        return
    os.execv(argv[0], argv)


@main.group()
def store():
    """Inspect, check and repair hidden-state stores."""


@command(store, "info", StorePath)
def store_info(cfg: StorePath):
    """Samples, tokens, raw vs on-disk bytes, ratio and the manifest."""
    from dspark.connector.base import open_store

    echo_json(open_store(cfg.path).info())


@command(store, "verify", StoreCheck, Progress)
def store_verify(cfg: StoreCheck, shown: Progress):
    """Read every sample back against its checksum, report damaged index records and, with --data,
    missing samples; non-zero exit on any of them."""
    from dspark.connector.base import open_store
    from dspark.data.prepare import PreparedData

    s = open_store(cfg.path)
    prepared = PreparedData(cfg.data) if cfg.data else None
    click.echo(s.check(len(prepared) if prepared else None, prepared.fingerprint if prepared else None, cfg.data,
                       progress=not shown.no_progress, say=lambda line: click.echo(line, err=True)))


@command(store, "repair", RepairConfig, Progress)
def store_repair(cfg: RepairConfig, shown: Progress):
    """Re-extract exactly the damaged and missing samples (transformers engine) into a new segment.

    Healthy segments are not touched; reads take the new copies from then on.
    """
    cfg = replace(cfg, model=local(cfg.model))
    from dspark.extract.runner import run_repair

    echo_json(run_repair(cfg, progress=not shown.no_progress))
