"""The `dspark` command line. Heavy imports stay inside commands: `dspark --help` is instant."""

from __future__ import annotations

import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import click

from dspark.codec import CODECS, DEFAULT_CODEC
from dspark.config import (FiniteFloatRange, IntList, MooncakeConfig, ServeLimits, build, check_settings,
                           config_file_option, nest, options)
from dspark.errors import DsparkError
from dspark.jsonio import dump_json
from dspark.train.config import TrainConfig

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
ACCEPT_OTHER_WEIGHTS = ("Write into a store extracted with a verifier of other weights (same config): its new "
                        "segment records them, and `dspark store info` lists it.")


class _Group(click.Group):
    """Turns user-facing errors into one line and a non-zero exit, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DsparkError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.secho("interrupted: rerun the same command to resume (extraction keeps every finished "
                        "sample; training resumes from its latest checkpoint)", fg="yellow", err=True)
            sys.exit(130)


def _echo_json(obj) -> None:
    click.echo(dump_json(obj, indent=2, default=str))


def _local(model: str | None) -> str | None:
    """A verifier as given (a folder, or a hub id in the Hugging Face cache) as the folder commands read."""
    from dspark.hub import local_model

    return str(local_model(model)) if model else model


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(package_name="dspark")
def main():
    """Turn a verifier LLM plus chat data into a vLLM-servable DSpark drafter."""
    # Our own progress bars say what is happening; the libraries' per-file bars and
    # INFO chatter would bury them. Users can override any of these.
    for key, value in (("TOKENIZERS_PARALLELISM", "false"), ("LOGURU_LEVEL", "ERROR"),
                       ("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("HF_HUB_OFFLINE", "1")):  # offline-first: models are local folders
        os.environ.setdefault(key, value)


@main.command("toy-verifier")
@click.option("--output", type=click.Path(path_type=Path), default=Path("cache/models/tiny"), show_default=True)
@click.option("--steps", type=int, default=None, help="Pre-training steps (default 150).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-position-embeddings", type=click.IntRange(min=64), default=None,
              help="Longest context (default 4096); long-context evals need more (e.g. 32768).")
def toy_verifier(output, steps, seed, max_position_embeddings):
    """Build a tiny pre-trained Qwen3 verifier + chat tokenizer, offline."""
    from dspark.toy import ToySpec, build_toy_verifier

    spec = ToySpec(seed=seed)
    if steps is not None:
        spec = replace(spec, steps=steps)
    if max_position_embeddings is not None:
        spec = replace(spec, max_position_embeddings=max_position_embeddings)
    _echo_json(build_toy_verifier(output, spec))


@main.command("longbench")
@click.option("--output", required=True, type=click.Path(path_type=Path), help="The LongBench-format JSONL to write.")
@click.option("--model", required=True, help="Verifier folder or cached hub id (its tokenizer sizes the contexts).")
@click.option("--text", "texts", multiple=True, type=click.Path(path_type=Path),
              help="Local text or chat JSONL to build contexts from (default: the shipped demo chat).")
@click.option("--lengths", cls=IntList, default="2048 4096 8192", show_default=True,
              help="Target prompt lengths in tokens.")
@click.option("--per-length", type=click.IntRange(min=1), default=2, show_default=True,
              help="Records per length and sub-domain.")
@click.option("--seed", type=int, default=0, show_default=True)
def longbench_cmd(output, model, texts, lengths, per_length, seed):
    """Write a LongBench-format prompt file from local text, for `dspark eval --decode --prompts`."""
    from dspark.decode.longbench import generate, read_texts
    from dspark.prepare import load_tokenizer
    from dspark.toy import demo_chat_path

    corpus = [t for path in (texts or [demo_chat_path()]) for t in read_texts(path)]
    _echo_json(generate(corpus, load_tokenizer(_local(model)), output, list(lengths), per_length, seed))


@main.command()
@click.option("--data", required=True, type=click.Path(path_type=Path), help="Chat data in any format prepare reads.")
@click.option("--train", "train_out", required=True, type=click.Path(path_type=Path), help="Training JSONL to write.")
@click.option("--heldout-output", required=True, type=click.Path(path_type=Path), help="Held-out JSONL to write.")
@click.option("--heldout", type=click.IntRange(min=0), required=True, help="Conversations to hold out.")
@click.option("--exclude", multiple=True, type=click.Path(path_type=Path),
              help="A prompt file reported on (HumanEval, MT-bench, chat JSONL; repeatable): its prompts leave training.")
@click.option("--seed", type=int, default=0, show_default=True)
def holdout(data, train_out, heldout_output, heldout, exclude, seed):
    """Split chat data into training and held-out prompts; no prompt text is in both (duplicates dropped)."""
    from dspark.holdout import split

    _echo_json(split(data, train_out, heldout_output, heldout, seed, list(exclude)))


@main.command()
@click.option("--model", required=True, help="Verifier folder or cached hub id (for its tokenizer and chat template).")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--data", required=True, help="Chat JSONL: OpenAI `messages` or ShareGPT `conversations`.")
@click.option("--output", required=True)
@click.option("--seq-length", type=int, default=2048, show_default=True)
@click.option("--num-preprocessing-workers", type=int, default=1, show_default=True)
@click.option("--minimum-valid-tokens", type=int, default=1, show_default=True)
@click.option("--role-map", default=None, metavar="NAME=ROLE,...",
              help="Extra role names, e.g. 'bing=assistant,foo=user' (or JSON). Built in: human/prompter=user; "
                   "gpt/chatgpt/bing/bard/model/bot/ai=assistant. Conversations with other roles are dropped.")
@click.option("--strict", is_flag=True, help="Fail on the first conversation that would be dropped, naming its line.")
@click.option("--skip-invalid-lines", is_flag=True,
              help="Skip and count malformed-JSON and non-UTF-8 lines instead of failing on the first.")
@click.option("--template-timeout", type=FiniteFloatRange(min=0), default=5.0, show_default=True,
              help="Seconds the chat template may take to render one conversation (real ones take ms); longer "
                   "is dropped as template_timeout (an error with --strict). 0: no limit.")
def prepare(**kw):
    """Tokenize chat data with the model's template; mask all but assistant tokens.

    Conversations that cannot be trained on (empty, system-only, no assistant turn, an unknown
    role, too few supervised tokens) are dropped and counted by reason in the summary.
    """
    from dspark.prepare import PrepareConfig
    from dspark.prepare import prepare as run

    kw["model"] = _local(kw["model"])
    summary = run(PrepareConfig(**kw))
    status = "up to date, nothing to do" if summary.pop("up_to_date") else "written"
    click.echo(f"prepare {kw['output']}: {status}")
    if summary.get("dropped") or summary.get("invalid_lines"):
        reasons = ", ".join(f"{r} {n}" for r, n in summary.get("dropped_by_reason", {}).items())
        skipped = f"; skipped {summary['invalid_lines']} invalid lines" if summary.get("invalid_lines") else ""
        click.secho(f"kept {summary['kept']} of {summary['conversations']} conversations; dropped "
                    f"{summary['dropped']}{f' ({reasons})' if reasons else ''}{skipped}", fg="yellow", err=True)
    for warning in summary.get("warnings", []):
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    _echo_json(summary)


from dspark.regenerate import RegenerateConfig  # noqa: E402  (torch-free: its fields make the options below)


@main.command()
@config_file_option(RegenerateConfig)
@options(RegenerateConfig)
@click.option("--no-progress", is_flag=True)
def regenerate(no_progress, **kw):
    """The verifier writes its own replies to a chat file's prompts (chat JSONL for `dspark prepare`).

    First assistant turn only; resumable and crash-safe (rerun the same command); a summary is
    printed and saved as OUTPUT.summary.json. Run from .venv-vllm for --engine vllm.
    """
    from dspark.regenerate import regenerate as run

    cfg = build(RegenerateConfig, nest(kw), "the command line")
    summary = run(replace(cfg, model=_local(cfg.model)), progress=not no_progress)
    click.echo(f"regenerate {summary['output']}: {summary['note']}", err=True)
    if summary["dropped"] or summary["truncated"]:
        reasons = ", ".join(f"{r} {n}" for r, n in summary["dropped_by_reason"].items())
        click.secho(f"wrote {summary['written']} of {summary['prompts']} prompts; {summary['truncated']} replies cut "
                    f"at --max-new-tokens (kept); dropped {summary['dropped']}{f' ({reasons})' if reasons else ''}",
                    fg="yellow", err=True)
    _echo_json(summary)


def _pop_config(kw: dict, name: str, cls):
    """Take the options `options(cls, prefix=(name,))` added out of a command's kwargs, as a `cls`."""
    mine = {k: kw.pop(k) for k in [k for k in kw if k.startswith(name + "__")]}
    cfg = build(cls, nest(mine)[name], f"--{name}-* options")
    check_settings(cfg, (name,))
    return cfg


@main.command()
@click.option("--to", "to", default="zarr", show_default=True, help="Sink(s): zarr, mooncake or zarr,mooncake.")
@click.option("--model", required=True, help="Verifier folder, or a hub id in the Hugging Face cache.")
@click.option("--data", required=True, help="A folder written by `dspark prepare`.")
@click.option("--store", default=None, help="Zarr store folder (created or resumed); default: "
              "cache/stores/<verifier>-L<layers>-<data>, where `dspark train` looks for it.")
@click.option("--target-layer-ids", cls=IntList, required=True, help="e.g. `1 3 5` or `1,3,5`.")
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers", show_default=True,
              help="vllm: vllm.LLM with our KV connector (run from .venv-vllm).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default=None, help="Override the verifier dtype (default: its config's).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Padded tokens per forward.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--fp8", is_flag=True, help="Store fp8 e4m3 with a scale per token and layer (half of bf16).")
@click.option("--codec", type=click.Choice(list(CODECS)), default=None,
              help=f"Zarr compression of a new store (default: {DEFAULT_CODEC}, the smallest; lz4 reads faster and "
              "stores larger: README, Performance). An existing store keeps its own.")
@click.option("--chunk-tokens", type=int, default=None, help="Tokens per chunk (default: ~1 MiB chunks).")
@click.option("--shard", default="0/1", show_default=True, help="INDEX/COUNT: this writer's share of batches.")
@click.option("--verifier-name", default=None, help="Name recorded in the manifest (default: folder name).")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--accept-other-weights", is_flag=True, help=ACCEPT_OTHER_WEIGHTS)
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="vllm engine: compute shared prompt prefixes once.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="vllm engine: devices one extraction process spans (one shard per node: see --shard).")
@click.option("--no-progress", is_flag=True)
@options(MooncakeConfig, prefix=("mooncake",))
def extract(fp8, no_progress, **kw):
    """Capture verifier hidden states into a Zarr store and/or Mooncake (resumable, crash-safe).

    --to mooncake streams each sample to the live store for a trainer reading with
    --from mooncake (producer-driven, with back-pressure); --to zarr,mooncake tees.
    """
    from dspark.extract.runner import ExtractConfig, run_extract

    mooncake = _pop_config(kw, "mooncake", MooncakeConfig)
    kw["model"] = _local(kw["model"])
    cfg = ExtractConfig(encoding="fp8_e4m3" if fp8 else "raw", mooncake=mooncake, **kw)
    _echo_json(run_extract(cfg, progress=not no_progress))


@main.command()
@config_file_option(TrainConfig)
@options(TrainConfig)
@click.option("--print-config", is_flag=True, help="Print the resolved settings (a --config file) and exit.")
@click.option("--force", is_flag=True, help="Resume even if the config or store changed.")
@click.option("--no-progress", is_flag=True)
def train(print_config, force, no_progress, **kw):
    """Train a DSpark drafter on stored (or live) hidden states; resumes from --save-path."""
    cfg = TrainConfig.from_dict(nest(kw), "the command line").validate()
    if print_config:
        _echo_json(cfg.to_dict())
        return
    from dspark.train.loop import Trainer

    cfg = replace(cfg, verifier_name_or_path=_local(cfg.verifier_name_or_path))
    _echo_json(Trainer(cfg, force=force, progress=not no_progress).fit())


@main.command()
@click.option("--model", required=True, help="Verifier folder, or a hub id in the Hugging Face cache.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--to", "--hidden-states-backend", "to", default="mooncake", show_default=True,
              help="Sink(s): mooncake, zarr or zarr,mooncake (--hidden-states-backend is the seed's name).")
@click.option("--store", default=None, help="Zarr store (with the zarr backend).")
@click.option("--data", default=None,
              help="Prepared data: pins the store identity (needed with zarr; live requests name their own).")
@click.option("--target-layer-ids", cls=IntList, required=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default=None)
@click.option("--trust-remote-code", is_flag=True)
@options(ServeLimits)
@options(MooncakeConfig, prefix=("mooncake",))
def serve(model, host, port, to, store, data, target_layer_ids, device, dtype, trust_remote_code, **kw):
    """OpenAI-compatible extraction server (the CPU/test stand-in for vLLM + our KV connector)."""
    from dspark.connector.config import SinkConfig
    from dspark.connector.producer import Producer
    from dspark.errors import InputError
    from dspark.extract.serve import ExtractionService, make_server
    from dspark.extract.transformers_engine import TransformersEngine
    from dspark.hub import model_name
    from dspark.prepare import PreparedData

    if "zarr" in to and (data is None or store is None):
        raise InputError("writing to a Zarr store needs --store and --data (the prepared folder it holds)",
                         "pass both, or use --to mooncake")
    limits = ServeLimits(**{f.name: kw.pop(f.name) for f in fields(ServeLimits)})
    model = _local(model)
    engine = TransformersEngine(model, target_layer_ids, device, dtype, trust_remote_code)
    mooncake = _pop_config(kw, "mooncake", MooncakeConfig)
    sinks = SinkConfig(to=to, store=store, prepared_fingerprint=PreparedData(data).fingerprint if data else None,
                       writer_threads=mooncake.writer_threads, mooncake=mooncake)
    producer = Producer(sinks, model, target_layer_ids, engine.dtype_name, trust_remote_code)
    server = make_server(ExtractionService(engine, producer, model_name(model), limits), host, port)
    click.echo(f"dspark serve: {model} on http://{host}:{port}/v1 -> {to}", err=True)
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
    from dspark.extract.launch import main as launch

    launch(argv)


from dspark.decode.config import CompareConfig, DecodeConfig, SamplingConfig  # noqa: E402  (torch-free)


@main.command("eval")
@click.option("--checkpoint", required=True, help="A checkpoint folder, e.g. RUN/latest.")
@click.option("--store", default=None, help="The Zarr store to score on (default: the run's).")
@click.option("--data-path", default=None, help="Prepared data (default: the run's).")
@click.option("--verifier-name-or-path", default=None, help="Verifier folder or cached hub id (default: the run's).")
@click.option("--split", type=click.Choice(["val", "all"]), default="val", show_default=True)
@click.option("--output", default=None, help="Folder for eval.json/.md/.png (default: CHECKPOINT/eval).")
@click.option("--device", default="auto", show_default=True)
@click.option("--on-damaged", type=click.Choice(["skip", "raise"]), default="skip", show_default=True,
              help="A sample failing its checksum (or whose chunk is lost): skip it, named at the end, or stop.")
@click.option("--max-anchors", type=click.IntRange(min=0), default=None, metavar="N",
              help="Blocks to score: a seeded uniform sample of N of the split's anchors (default 2048, "
                   "dspark.evaluate.MAX_ANCHORS); 0 scores every one. The report says how many of how many.")
@click.option("--anchor-seed", type=int, default=None, help="Which anchors are sampled (default 0): the same seed "
              "scores the same blocks, so checkpoints of one run compare on them.")
@click.option("--decode", is_flag=True, help="Also decode for real: the drafter proposes, the verifier checks, "
              "on --prompts; per-position acceptance per set, long-context buckets, speedup (decode.json/.md/.png).")
@click.option("--prompts", multiple=True, metavar="[NAME=]PATH", help="With --decode (repeatable): chat JSONL, "
              "ShareGPT, HumanEval, MT-bench question.jsonl, LongBench JSONL (any gzipped) or a prepared folder "
              "(default: the run's prepared data).")
@options(SamplingConfig)
@click.option("--layout", type=click.Choice(["dspark", "dflash-v1"]), default="dspark", show_default=True,
              help="dspark: as vLLM's DSpark speculator drafts (Model Runner V2); dflash-v1: as vLLM V1's "
                   "`method: dflash` would serve this checkpoint.")
@click.option("--num-speculative-tokens", type=click.IntRange(min=1), default=None, help="dflash-v1 only.")
@click.option("--confidence-threshold", type=FiniteFloatRange(0, 1, min_open=True), default=0.5, show_default=True,
              help="Also decode with blocks cut where the confidence head's running survival falls below this.")
@click.option("--no-confidence", is_flag=True, help="Skip the confidence-cut decode.")
@click.option("--no-progress", is_flag=True)
def eval_cmd(checkpoint, store, data_path, verifier_name_or_path, split, output, device, on_damaged, max_anchors,
             anchor_seed, decode, prompts, layout, num_speculative_tokens, confidence_threshold, no_confidence,
             no_progress, **sampling):
    """Per-position acceptance, tau, and tau by context length (JSON, Markdown, PNG); --decode adds real decoding."""
    from dspark.evaluate import markdown, run_eval

    verifier_name_or_path = _local(verifier_name_or_path)
    if decode:  # its mistakes are one line before the teacher-forced pass, not after it
        cfg = DecodeConfig(checkpoint=checkpoint, prompts=list(prompts), verifier=verifier_name_or_path,
                           layout=layout, num_speculative_tokens=num_speculative_tokens,
                           confidence_threshold=None if no_confidence else confidence_threshold,
                           **sampling).validate()
    sample = {k: v for k, v in (("max_anchors", max_anchors), ("anchor_seed", anchor_seed)) if v is not None}
    result, out = run_eval(checkpoint, store, data_path, verifier_name_or_path, output, split, device, on_damaged,
                           **sample)
    click.echo(markdown(result))
    click.echo(f"wrote {out}/eval.json, eval.md, eval.png")
    if decode:
        from dspark.decode.report import markdown as decode_markdown
        from dspark.decode.run import run_decode

        decoded, out = run_decode(cfg, teacher_forced=result, output=output, progress=not no_progress)
        click.echo(decode_markdown(decoded))
        click.echo(f"wrote {out}/decode.json, decode.md, decode.png")


@main.command()
@config_file_option(CompareConfig)
@options(CompareConfig)
@click.option("--no-progress", is_flag=True)
def compare(no_progress, **kw):
    """Drafters of every kind (checkpoints or exports) and prompt lookup, side by side in one decode loop.

    The same prompts and seeds for each: per set, per-position acceptance, mean acceptance length,
    drafted tokens/s, speedup over the verifier alone, training steps and time, parameters.
    Writes OUTPUT/compare.json/.md/.png (one bar per drafter per set).
    """
    from dspark.decode.compare import markdown, run_compare

    cfg = build(CompareConfig, nest(kw), "the command line")
    result, out = run_compare(cfg, progress=not no_progress)
    click.echo(markdown(result))
    click.echo(f"wrote {out}/compare.json, compare.md, compare.png")


from dspark.bench.run import BenchConfig  # noqa: E402  (torch-free: its fields make the options below)


@main.command()
@config_file_option(BenchConfig)
@options(BenchConfig)
@click.option("--no-progress", is_flag=True)
def bench(no_progress, **kw):
    """Measure a running vLLM server: per-position acceptance from its own counters, tokens/s, TTFT, ITL.

    Works against any vLLM deployment (GPU or CPU); --compare-endpoint sends the same prompts to a
    second server (e.g. without speculative decoding) for the speedup. Writes OUTPUT/bench.json/.md/.png.
    """
    from dspark.bench.run import run_bench
    from dspark.bench.report import markdown

    cfg = build(BenchConfig, nest(kw), "the command line")
    result, out = run_bench(cfg, progress=not no_progress,
                            warn=lambda line: click.secho(f"warning: {line}", fg="yellow", err=True))
    click.echo(markdown(result))
    click.echo(f"wrote {out}/bench.json, bench.md, bench.png")


from dspark.serve_draft import ServeDraftConfig  # noqa: E402  (torch-free: its fields make the options below)


@main.command("serve-draft")
@config_file_option(ServeDraftConfig)
@options(ServeDraftConfig)
@click.option("--print-only", is_flag=True, help="Print the vLLM command, its environment and speculative config.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_FLAGS...]")
def serve_draft(print_only, vllm_args, **kw):
    """Serve the verifier in vLLM with an exported drafter (the speculative config its layout needs), n-gram
    drafts, or none: what `dspark bench` measures. Run it from the environment that has vLLM (.venv-vllm)."""
    from dspark.serve_draft import serve_draft as run

    cfg = build(ServeDraftConfig, nest(kw), "the command line")
    sys.exit(run(cfg, list(vllm_args), print_only,
                 warn=lambda line: click.secho(f"WARNING: {line}", fg="red", err=True)))


@main.command("export")
@click.argument("checkpoint")
@click.option("--output", required=True)
@click.option("--verifier-name", required=True, help="How vLLM users name the verifier, e.g. Org/Model.")
@click.option("--force", is_flag=True, help="Write into a non-empty --output that is not an export of CHECKPOINT.")
def export_cmd(checkpoint, output, verifier_name, force):
    """Write a vLLM-loadable drafter folder and print its `vllm serve` line."""
    from dspark.export import export

    result = export(checkpoint, output, verifier_name, force)
    click.echo(result["serve"])
    click.secho(result["note"], fg="yellow", err=True)
    click.echo(f"wrote {result['export']} ({', '.join(result['files'])})")


@main.command("replay")
@click.argument("run")
@click.option("--store", default=None, help="The run's store, if it moved.")
@click.option("--tolerance", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
              help="Relative/absolute (GPU runs).")
@click.option("--logger", default="jsonl", show_default=True,
              help="Trackers the replay logs to, as `train --logger` (default: none, only its metrics.jsonl).")
@click.option("--no-progress", is_flag=True)
def replay_cmd(run, store, tolerance, logger, no_progress):
    """Retrain RUN from its record and prove every logged metric reproduces."""
    from dspark.replay import replay

    result = replay(run, store, tolerance, progress=not no_progress, logger=logger)
    _echo_json(result)
    if result["reproduced"]:
        click.secho(f"REPRODUCED: {result['records']} records, {result['metrics_compared']} metrics match", fg="green")
    else:
        click.secho(f"DIVERGED: {result['first_divergence']}", fg="red", err=True)
        sys.exit(1)


@main.group()
def verifier():
    """Bring a verifier in from other formats."""


@verifier.command("import")
@click.argument("source")
@click.option("--output", required=True, type=click.Path(path_type=Path), help="The model folder to write.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="Weight dtype of the written safetensors.")
@click.option("--force", is_flag=True, help="Overwrite a non-empty --output.")
def verifier_import_cmd(source, output, dtype, force):
    """Dequantize a GGUF into a plain Hugging Face folder (model, tokenizer, chat template).

    SOURCE: a .gguf path, `pkg:PACKAGE/PATH` (a file inside an installed package) or an alias
    (`smollm2-135m-instruct`). Rerunning a finished import writes nothing."""
    from dspark.verifier_import import import_gguf

    _echo_json(import_gguf(source, output, dtype=dtype, force=force))


@main.group()
def store():
    """Inspect, check and repair hidden-state stores."""


@store.command("info")
@click.argument("path")
def store_info(path):
    """Samples, tokens, raw vs on-disk bytes, ratio and the manifest."""
    from dspark.connector.zarr_store import ZarrStore

    _echo_json(ZarrStore(path).info())


@store.command("verify")
@click.argument("path")
@click.option("--data", default=None,
              help="The prepared folder the store was extracted from: also find the samples the store lacks.")
@click.option("--no-progress", is_flag=True)
def store_verify(path, data, no_progress):
    """Read every sample back against its checksum, report damaged index records and, with --data,
    missing samples; non-zero exit on any of them."""
    from dspark.connector.zarr_store import ZarrStore, check_store
    from dspark.errors import StoreError, StoreMismatch, repair_command
    from dspark.prepare import PreparedData

    s = ZarrStore(path)
    prepared = PreparedData(data) if data else None
    if prepared and prepared.fingerprint != s.manifest.prepared_fingerprint:
        raise StoreMismatch(f"store {path} was extracted from other prepared data than {data}",
                            "pass --data the prepared folder the store was extracted from")
    found = check_store(s, len(prepared) if prepared else None, progress=not no_progress)
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


@store.command("repair")
@click.argument("path")
@click.option("--data", required=True, help="The prepared folder the store was extracted from.")
@click.option("--model", required=True, help="The verifier folder or cached hub id the store was extracted with.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--batch-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="As the store's extraction used: the same batches give byte-identical states.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--accept-other-weights", is_flag=True, help=ACCEPT_OTHER_WEIGHTS)
@click.option("--no-progress", is_flag=True)
def store_repair(path, data, model, device, batch_tokens, max_batch_size, trust_remote_code, accept_other_weights,
                 no_progress):
    """Re-extract exactly the damaged and missing samples (transformers engine) into a new segment.

    Healthy segments are not touched; reads take the new copies from then on.
    """
    from dspark.extract.runner import run_repair

    _echo_json(run_repair(path, data, _local(model), device, batch_tokens, max_batch_size, trust_remote_code,
                          progress=not no_progress, accept_other_weights=accept_other_weights))


if __name__ == "__main__":
    main()
