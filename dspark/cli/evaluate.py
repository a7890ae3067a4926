"""Commands that measure and ship a drafter: eval, compare, export."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import click

from dspark.cli.app import Progress, command, local, main
from dspark.core.settings import setting
from dspark.decode.config import CompareConfig, DecodeConfig, DecodeOptions
from dspark.eval.config import TeacherForcedConfig
from dspark.export.folder import ExportConfig


@dataclass
class EvalConfig(TeacherForcedConfig):
    """`dspark eval`: per-position acceptance and tau of a checkpoint; `decode` adds real decoding."""

    decode: bool = setting(False, "Also decode for real: the drafter proposes, the verifier checks, on --prompts; "
                                  "per-position acceptance per set, long-context buckets, speedup "
                                  "(decode.json/.md/.png).", negatable=False)
    decoding: DecodeOptions = setting(factory=DecodeOptions, prefixed=False)

    def decode_config(self) -> DecodeConfig:
        """The `--decode` settings, checked (before the teacher-forced pass, not after it)."""
        return DecodeConfig(checkpoint=self.checkpoint, verifier=self.verifier_name_or_path,
                            **{f.name: getattr(self.decoding, f.name) for f in fields(self.decoding)}).validate()


@command(main, "eval", EvalConfig, Progress)
def eval_cmd(cfg: EvalConfig, shown: Progress):
    """Per-position acceptance, tau, and tau by context length (JSON, Markdown, PNG); --decode adds real decoding."""
    from dspark.eval.teacher_forced import markdown, run_eval

    verifier = local(cfg.verifier_name_or_path)
    if cfg.decode:  # its mistakes are one line before the teacher-forced pass, not after it
        decoding = cfg.decode_config()
    result, out = run_eval(replace(cfg, verifier_name_or_path=verifier), not shown.no_progress)
    click.echo(markdown(result))
    click.echo(f"wrote {out}/eval.json, eval.md, eval.png")
    if cfg.decode:
        from dspark.decode.report import markdown as decode_markdown
        from dspark.decode.run import run_decode

        decoded, out = run_decode(replace(decoding, verifier=verifier), teacher_forced=result, output=cfg.output,
                                  progress=not shown.no_progress)
        click.echo(decode_markdown(decoded))
        click.echo(f"wrote {out}/decode.json, decode.md, decode.png")


@command(main, "compare", CompareConfig, Progress, config_file=CompareConfig)
def compare(cfg: CompareConfig, shown: Progress):
    """Drafters of every kind (checkpoints or exports) and prompt lookup, side by side in one decode loop.

    The same prompts and seeds for each: per set, per-position acceptance, mean acceptance length,
    drafted tokens/s, speedup over the verifier alone, training steps and time, parameters.
    Writes OUTPUT/compare.json/.md/.png (one bar per drafter per set).
    """
    cfg.validate()  # its refusals come before the decode loop's imports (torch)
    from dspark.decode.compare import markdown, run_compare

    result, out = run_compare(cfg, progress=not shown.no_progress)
    click.echo(markdown(result))
    click.echo(f"wrote {out}/compare.json, compare.md, compare.png")


@command(main, "export", ExportConfig)
def export(cfg: ExportConfig):
    """Write a vLLM-loadable drafter folder and print its `vllm serve` line."""
    from dspark.export.folder import export as run

    result = run(cfg.checkpoint, cfg.output, cfg.verifier_name, cfg.force)
    click.echo(result["serve"])
    click.secho(result["note"], fg="yellow", err=True)
    click.echo(f"wrote {result['export']} ({', '.join(result['files'])})")
