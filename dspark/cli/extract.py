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
    from dspark.extract.runner import run_extract

    echo_json(run_extract(replace(cfg, model=local(cfg.model)), progress=not shown.no_progress))


@command(main, "serve", ServeConfig)
def serve(cfg: ServeConfig):
    """OpenAI-compatible extraction server (the CPU/test stand-in for vLLM + our KV connector)."""
    from dspark.connector.producer import Producer
    from dspark.extract.serve import ExtractionService, make_server
    from dspark.extract.transformers_engine import TransformersEngine
    from dspark.hub import model_name
    from dspark.prepare import PreparedData

    model = local(cfg.model)
    engine = TransformersEngine(model, cfg.target_layer_ids, cfg.device, cfg.dtype, cfg.trust_remote_code)
    sinks = cfg.sink.for_data(PreparedData(cfg.data).fingerprint if cfg.data else None)
    producer = Producer(sinks, model, cfg.target_layer_ids, engine.dtype_name, cfg.trust_remote_code)
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
    from dspark.connector.zarr.reader import ZarrStore

    echo_json(ZarrStore(cfg.path).info())


@command(store, "verify", StoreCheck, Progress)
def store_verify(cfg: StoreCheck, shown: Progress):
    """Read every sample back against its checksum, report damaged index records and, with --data,
    missing samples; non-zero exit on any of them."""
    from dspark.connector.zarr.reader import ZarrStore
    from dspark.connector.zarr.verify import verify_store
    from dspark.errors import StoreError, repair_command
    from dspark.prepare import PreparedData

    path, data = cfg.path, cfg.data
    s = ZarrStore(path)
    prepared = PreparedData(data) if data else None
    if prepared:
        s.manifest.require_match(path, f"pass --data the prepared folder the store was extracted from ({data} is other "
                                 "prepared data)", prepared_fingerprint=prepared.fingerprint)
    found = verify_store(s, len(prepared) if prepared else None, progress=not shown.no_progress)
    for i in sorted(found.damaged)[:20]:
        click.echo(f"sample {i}: {found.damaged[i]}", err=True)
    for seg, off, after in found.damaged_records[:20]:
        click.echo(f"segment {seg}: index record {off // 32} (byte {off}) is damaged; the {after} valid records "
                   "after it are read", err=True)
    if found.missing:
        click.echo(f"missing: {len(found.missing)} of {len(prepared)} prepared samples, first {found.missing[:20]}",
                   err=True)
    if found.problems:
        raise StoreError(f"store {path}: " + "; ".join(found.problems),
                         f"{repair_command(path, data)} re-extracts exactly these samples"
                         + ("" if prepared else " (and `store verify --data` names the missing ones)"))
    note = "" if prepared else " (not compared with the prepared data: pass --data to find missing samples)"
    click.echo(f"ok: {len(s)} samples verified in {path}" + (f", all {len(prepared)} prepared samples present"
                                                             if prepared else note))


@command(store, "repair", RepairConfig, Progress)
def store_repair(cfg: RepairConfig, shown: Progress):
    """Re-extract exactly the damaged and missing samples (transformers engine) into a new segment.

    Healthy segments are not touched; reads take the new copies from then on.
    """
    from dspark.extract.runner import run_repair

    echo_json(run_repair(cfg.store, cfg.data, local(cfg.model), cfg.device, cfg.batch_tokens, cfg.max_batch_size,
                         cfg.trust_remote_code, progress=not shown.no_progress,
                         accept_other_weights=cfg.accept_other_weights))
