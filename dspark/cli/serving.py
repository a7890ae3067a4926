"""Commands around a running vLLM server: serve-draft starts one, bench measures it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import click

from dspark.serving.bench.run import BenchConfig
from dspark.cli.app import Progress, command, main, warn
from dspark.cli.options import config_file_option, configs, options
from dspark.serving.serve_draft import ServeDraftConfig
from dspark.core.settings import setting


@command(main, "bench", BenchConfig, Progress, config_file=BenchConfig)
def bench(cfg: BenchConfig, shown: Progress):
    """Measure a running vLLM server: per-position acceptance from its own counters, tokens/s, TTFT, ITL.

    Works against any vLLM deployment (GPU or CPU); --compare-endpoint sends the same prompts to a
    second server (e.g. without speculative decoding) for the speedup. Writes OUTPUT/bench.json/.md/.png.
    """
    from dspark.serving.bench.report import markdown
    from dspark.serving.bench.run import run_bench

    result, out = run_bench(cfg, progress=not shown.no_progress, warn=warn)
    click.echo(markdown(result))
    click.echo(f"wrote {out}/bench.json, bench.md, bench.png")


@dataclass
class PrintOnly:
    print_only: bool = setting(False, "Print the vLLM command, its environment and speculative config.",
                               negatable=False)


@main.command("serve-draft")
@config_file_option(ServeDraftConfig)
@options(ServeDraftConfig, PrintOnly)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_FLAGS...]")
def serve_draft(vllm_args, **kw):
    """Serve the verifier in vLLM with an exported drafter (the speculative config its layout needs), n-gram
    drafts, or none: what `dspark bench` measures. Run it from the environment that has vLLM (.venv-vllm)."""
    from dspark.serving.serve_draft import serve_draft as run

    cfg, shown = configs(kw, ServeDraftConfig, PrintOnly)
    sys.exit(run(cfg, list(vllm_args), shown.print_only))
