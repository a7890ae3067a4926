"""Commands that make a verifier and data: toy-verifier, verifier import, longbench, holdout, prepare, regenerate."""

from __future__ import annotations

from dataclasses import replace

import click

from dspark.cli.app import Progress, command, echo_json, local, main
from dspark.data.longbench import LongBenchConfig
from dspark.data.holdout import HoldoutConfig
from dspark.data.prepare import PrepareConfig
from dspark.data.regenerate import RegenerateConfig
from dspark.verifier.toy import ToyVerifierConfig
from dspark.verifier.importer import ImportConfig


@command(main, "toy-verifier", ToyVerifierConfig)
def toy_verifier(cfg: ToyVerifierConfig):
    """Build a tiny pre-trained Qwen3 verifier + chat tokenizer, offline."""
    from pathlib import Path

    from dspark.verifier.toy import build_toy_verifier

    echo_json(build_toy_verifier(Path(cfg.output), cfg.spec))


@main.group()
def verifier():
    """Bring a verifier in from other formats."""


@command(verifier, "import", ImportConfig)
def verifier_import(cfg: ImportConfig):
    """Dequantize a GGUF into a plain Hugging Face folder (model, tokenizer, chat template).

    SOURCE: a .gguf path, `pkg:PACKAGE/PATH` (a file inside an installed package) or an alias
    (`smollm2-135m-instruct`). Rerunning a finished import writes nothing."""
    from pathlib import Path

    from dspark.verifier.importer import import_gguf

    echo_json(import_gguf(cfg.source, Path(cfg.output), dtype=cfg.dtype, force=cfg.force))


@command(main, "longbench", LongBenchConfig)
def longbench(cfg: LongBenchConfig):
    """Write a LongBench-format prompt file from local text, for `dspark eval --decode --prompts`."""
    from pathlib import Path

    from dspark.data.longbench import generate, read_texts
    from dspark.data.prepare import load_tokenizer
    from dspark.verifier.toy import demo_chat_path

    corpus = [t for path in (cfg.texts or [demo_chat_path()]) for t in read_texts(Path(path))]
    echo_json(generate(corpus, load_tokenizer(local(cfg.model)), Path(cfg.output), list(cfg.lengths),
                       cfg.per_length, cfg.seed))


@command(main, "holdout", HoldoutConfig)
def holdout(cfg: HoldoutConfig):
    """Split chat data into training and held-out prompts; no prompt text is in both (duplicates dropped)."""
    from pathlib import Path

    from dspark.data.holdout import split

    echo_json(split(Path(cfg.data), Path(cfg.train), Path(cfg.heldout_output), cfg.heldout, cfg.seed,
                    [Path(p) for p in cfg.exclude], cfg.force))


@command(main, "prepare", PrepareConfig, config_file=PrepareConfig)
def prepare(cfg: PrepareConfig):
    """Tokenize chat data with the model's template; mask all but assistant tokens.

    Conversations that cannot be trained on (empty, system-only, no assistant turn, an unknown
    role, too few supervised tokens) are dropped and counted by reason in the summary.
    """
    from dspark.data.prepare import prepare as run

    summary = run(replace(cfg, model=local(cfg.model)))
    status = "up to date, nothing to do" if summary.pop("up_to_date") else "written"
    click.echo(f"prepare {cfg.output}: {status}")
    if summary.get("dropped") or summary.get("invalid_lines"):
        reasons = ", ".join(f"{r} {n}" for r, n in summary.get("dropped_by_reason", {}).items())
        skipped = f"; skipped {summary['invalid_lines']} invalid lines" if summary.get("invalid_lines") else ""
        click.secho(f"kept {summary['kept']} of {summary['conversations']} conversations; dropped "
                    f"{summary['dropped']}{f' ({reasons})' if reasons else ''}{skipped}", fg="yellow", err=True)
    for warning in summary.get("warnings", []):
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    echo_json(summary)


@command(main, "regenerate", RegenerateConfig, Progress, config_file=RegenerateConfig)
def regenerate(cfg: RegenerateConfig, shown: Progress):
    """The verifier writes its own replies to a chat file's prompts (chat JSONL for `dspark prepare`).

    First assistant turn only; resumable and crash-safe (rerun the same command); a summary is
    printed and saved as OUTPUT.summary.json. Run from .venv-vllm for --engine vllm.
    """
    from dspark.data.regenerate import regenerate as run

    summary = run(replace(cfg, model=local(cfg.model)), progress=not shown.no_progress)
    click.echo(f"regenerate {summary['output']}: {summary['note']}", err=True)
    if summary["dropped"] or summary["truncated"]:
        reasons = ", ".join(f"{r} {n}" for r, n in summary["dropped_by_reason"].items())
        click.secho(f"wrote {summary['written']} of {summary['prompts']} prompts; {summary['truncated']} replies cut "
                    f"at --max-new-tokens (kept); dropped {summary['dropped']}{f' ({reasons})' if reasons else ''}",
                    fg="yellow", err=True)
    echo_json(summary)
