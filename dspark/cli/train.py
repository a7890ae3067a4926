"""Commands that train and reproduce: train, replay."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import click

from dspark.cli.app import Progress, command, echo_json, local, main
from dspark.core.settings import setting
from dspark.train.config import ReplayConfig, TrainConfig


@dataclass
class TrainActions:
    """What `dspark train` does with its settings besides training on them."""

    print_config: bool = setting(False, "Print the resolved settings (a --config file) and exit.", negatable=False)
    force: bool = setting(False, "Resume even if the config or store changed.", negatable=False)


@command(main, "train", TrainConfig, TrainActions, Progress, config_file=TrainConfig)
def train(cfg: TrainConfig, actions: TrainActions, shown: Progress):
    """Train a DSpark drafter on stored (or live) hidden states; resumes from --save-path."""
    cfg = cfg.validate()
    if actions.print_config:
        echo_json(cfg.to_dict())
        return
    cfg = replace(cfg, verifier_name_or_path=local(cfg.verifier_name_or_path))  # a missing one: refused before torch
    from dspark.train.loop import Trainer

    echo_json(Trainer(cfg, force=actions.force, progress=not shown.no_progress).fit())


@command(main, "replay", ReplayConfig, Progress)
def replay(cfg: ReplayConfig, shown: Progress):
    """Retrain RUN from its record and prove every logged metric reproduces."""
    from dspark.replay import replay as run

    result = run(cfg, progress=not shown.no_progress)
    echo_json(result)
    if result["reproduced"]:
        click.secho(f"REPRODUCED: {result['records']} records, {result['metrics_compared']} metrics match", fg="green")
    else:
        click.secho(f"DIVERGED: {result['first_divergence']}", fg="red", err=True)
        sys.exit(1)
