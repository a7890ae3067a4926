"""`--logger` and the tracker settings, defined once for `dspark train`, its config files and replays."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.core.settings import setting
from dspark.core.errors import InputError
from dspark.core.registry import Registry

# each tracker's class, imported at its first lookup
TRACKERS = Registry("tracker", "--logger", {name: f"dspark.tracking.backends:{cls}" for name, cls in (
    ("tensorboard", "TensorBoard"), ("mlflow", "MLflow"), ("wandb", "Wandb"), ("trackio", "Trackio"))})
ALWAYS = "jsonl"  # RUN/metrics.jsonl: the run's record, written whatever --logger says


@dataclass
class TrackingConfig:
    """Which experiment trackers a run logs to, and under what names."""

    logger: str = setting(
        ALWAYS, "Experiment trackers, comma-separated: tensorboard, mlflow, wandb, trackio (jsonl, RUN/metrics.jsonl, "
                "is always on). Offline by default: TensorBoard and an MLflow file store in the run folder, wandb in "
                "offline mode (unless WANDB_MODE says otherwise), trackio's local store (TRACKIO_DIR).")
    tracking_uri: str | None = setting(
        None, "MLflow tracking URI, e.g. http://mlflow:5000 or file:///shared/mlruns (default: file store RUN/mlruns).")
    tracking_project: str = setting("dspark", "MLflow experiment, wandb and trackio project the run goes into.")
    run_name: str | None = setting(None, "The run's name in the trackers (default: the run folder's name).")
    log_checkpoints: bool = setting(
        False, "Also log each checkpoint folder as an artifact (mlflow, wandb, trackio; TensorBoard has no artifact store).",
        negatable=False)

    def trackers(self) -> list[str]:
        """The named trackers, in the order given, without jsonl; an unknown name is one line."""
        names = [n.strip().lower() for n in self.logger.split(",") if n.strip()]
        unknown = [n for n in names if n not in TRACKERS and n != ALWAYS]
        if unknown:
            raise InputError(f"--logger {self.logger!r}: unknown tracker {unknown[0]!r}",
                             f"use a comma-separated list of {', '.join((*TRACKERS.names(), ALWAYS))}")
        return list(dict.fromkeys(n for n in names if n != ALWAYS))
