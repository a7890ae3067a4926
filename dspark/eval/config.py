"""`dspark eval`'s teacher-forced settings (torch-free: the CLI builds its options from them): which checkpoint is
scored on which store and split, where, and on how many blocks. cli/evaluate.py's EvalConfig adds `--decode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dspark.core.settings import setting

# Blocks scored per eval, over all batches: a rate's standard error is at most 0.5/sqrt(2048) = 0.011,
# and 2048 blocks take about a minute on 2 CPU cores for a 135M verifier (every anchor of 24
# ShareGPT samples, 17,765 blocks, took 12 minutes). 0 scores every anchor.
MAX_ANCHORS = 2048
ANCHOR_SEED = 0  # which anchors: the same seed scores the same blocks, so two checkpoints compare on them


@dataclass
class TeacherForcedConfig:
    """What `dspark eval` scores teacher-forced, and how (`run_eval` takes it as it is)."""

    checkpoint: str = setting(help="A checkpoint folder, e.g. RUN/latest.")
    store: str | None = setting(None, "The Zarr store to score on (default: the run's).")
    data_path: str | None = setting(None, "Prepared data (default: the run's).")
    verifier_name_or_path: str | None = setting(
        None, "Verifier folder or cached hub id (default: the run's).")
    split: Literal["val", "all"] = setting("val")
    output: str | None = setting(None, "Folder for eval.json/.md/.png (default: CHECKPOINT/eval).")
    device: str = setting("auto")
    on_damaged: Literal["skip", "raise"] = setting(
        "skip", "A sample failing its checksum (or whose chunk is lost): skip it, named at the end, or stop.")
    max_anchors: int = setting(
        MAX_ANCHORS, "Blocks to score: a seeded uniform sample of N of the split's anchors; 0 scores every one. "
                     "The report says how many of how many.", ge=0, metavar="N")
    anchor_seed: int = setting(ANCHOR_SEED, "Which anchors are sampled: the same seed scores the same blocks, so "
                                            "checkpoints of one run compare on them.")
