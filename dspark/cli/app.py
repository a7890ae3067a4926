"""The `dspark` group, its one-line errors, and what every command shares."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import click

from dspark.core.errors import DsparkError
from dspark.core.jsonio import dump_json
from dspark.core.settings import setting

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass
class Progress:
    """Whether long work draws progress bars (they go to stderr)."""

    no_progress: bool = setting(False, "Draw no progress bars.", negatable=False)


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


def echo_json(obj) -> None:
    click.echo(dump_json(obj, indent=2, default=str))


def warn(line: str) -> None:
    click.secho(f"warning: {line}", fg="yellow", err=True)


def local(model: str | None) -> str | None:
    """A verifier as given (a folder, or a hub id in the Hugging Face cache) as the folder commands read."""
    from dspark.verifier.hub import local_model

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
    if "transformers" in sys.modules:  # read those at its import: a caller that imported it first gets them now
        from transformers.utils import logging as hf_logging

        if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] not in ("", "0"):
            hf_logging.disable_progress_bar()
        hf_logging.set_verbosity(hf_logging.log_levels.get(os.environ["TRANSFORMERS_VERBOSITY"], hf_logging.ERROR))


def command(group: click.Group, name: str, *classes, config_file=None):
    """A command whose every parameter is a setting of `classes`; the function gets their configs, built
    and checked, in that order (`config_file`: the class `--config FILE` fills)."""

    def decorate(fn):
        from dspark.cli.options import configs, config_file_option, options

        def run(**kw):
            return fn(*configs(kw, *classes))

        run.__doc__, run.__name__ = fn.__doc__, fn.__name__
        run = options(*classes)(run)
        if config_file is not None:
            run = config_file_option(config_file, name)(run)
        return group.command(name)(run)
    return decorate
