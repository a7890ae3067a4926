"""The training run's configuration: one dataclass, recorded in the run folder, replayed from it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from dspark.connector.registry import SOURCES
from dspark.connector.config import LiveConfig
from dspark.core.settings import build, check_settings, setting
from dspark.core.errors import InputError
from dspark.kinds import DEFAULT_KIND, KINDS
from dspark.core.records import integer, list_of, mapping, optional, read_run, settings_schema, text
from dspark.tracking.config import TrackingConfig

# The run plans every epoch's batches up front (a list of sample ids each, for the schedule's step count):
# more epochs than this is a typo, and 1e29 of them was a MemoryError.
MAX_EPOCHS = 1000
# speculators' loss names (speculators.losses.utils' loss maps) and DSpark Markov head types
# (DSparkSpeculatorConfig.markov_head_type): kept here so that checking a setting imports neither speculators
# nor torch; tests/test_startup.py holds them equal to speculators' own.
LOSS_FNS = ("ce", "jsd", "kl_div", "lk_hybrid", "nla", "rkl", "tv")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class TrainConfig:
    """`dspark train`'s settings (the seed's `train.py` flags, under their names): each one's only definition.

    `result_neutral` marks what may change on a resume or replay without changing the result: how and where
    it runs, its source (a live run's cache holds exactly the samples it trained on) and the damage policy
    (on an intact store it never acts, and what it skips is named).
    """

    data_path: str = setting(help="The prepared folder the store was extracted from.")
    verifier_name_or_path: str = setting(help="The verifier: a local folder, or a hub id in the Hugging Face cache.")
    save_path: str = setting(help="Run folder (resumed if it exists).", result_neutral=True)
    target_layer_ids: list[int] = setting(help="Verifier layers the drafter reads, e.g. `1 3 5` or `1,3,5`.",
                                          distinct=True)
    source: Literal[SOURCES.choices()] = setting(
        "zarr", "Where hidden states come from (--hidden-states-backend is the seed's name).",
        flags=("--from", "--hidden-states-backend"), result_neutral=True)
    store: str | None = setting(
        None, "Zarr store (--from zarr) or the local cache a live run fills (--from mooncake); default: "
              "cache/stores/<verifier>-L<layers>-<data>, where `dspark extract` puts it.", flags=("--store", "--cache"))
    trust_remote_code: bool = setting(False, negatable=False)
    accept_other_weights: bool = setting(
        False, "Train on a store extracted with a verifier of other weights (same config) knowingly.", negatable=False)
    draft_config: str | None = setting(None, "JSON file with the draft decoder layer config.")
    num_layers: int = setting(1, "Draft decoder layers.", ge=1)
    draft_vocab_size: int | None = setting(None, "Reduced draft vocabulary (from prepare's token frequencies).", ge=1)
    mask_token_id: int | None = setting(None, "Default: the tokenizer's mask token.", ge=0)
    epochs: int = setting(1, ge=1, le=MAX_EPOCHS)
    checkpoint_freq: float = setting(1.0, "Fraction of an epoch.", gt=0)
    total_seq_len: int = setting(2048, "Tokens per packed batch.", ge=2)
    train_data_ratio: float = setting(0.9, "Fraction of samples trained on; the rest validates.")
    speculator_type: Literal[KINDS.choices()] = setting(
        DEFAULT_KIND, "The drafter kind: dspark (DFlash + Markov bias + confidence heads), dflash (speculators' "
                  "DFlashDraftModel, no Markov or confidence head) or eagle3 (speculators' Eagle3DraftModel: "
                  "autoregressive, exactly 3 target layers, training-time test); all from the same store.")
    block_size: int = setting(8, "Tokens per block: slots the drafter fills (drafts: block_size with "
                                 "--sample-from-anchor, block_size - 1 without).", ge=1)
    sample_from_anchor: bool | None = setting(
        None, "Slot k of a block anchored at p predicts token p+k+1 (DSpark's layout, block_size drafts; "
              "served by vLLM's `method: dspark`). --no-sample-from-anchor: slot 0 is the anchor, untrained, and "
              "slot k predicts p+k (DFlash's layout, block_size - 1 drafts; what vLLM's V1 `method: dflash` serves). "
              "Default: the kind's own (on for dspark, off for dflash).")
    max_anchors: int = setting(512, "Blocks sampled per batch.", ge=1)
    dflash_decay_gamma: float = setting(4.0, "Loss decay over block positions.", gt=0)
    per_position_loss_weight: Literal["fixed-exp-decay", "dpace"] = setting(
        "fixed-exp-decay", "How a block position's loss is weighted: fixed-exp-decay (by --dflash-decay-gamma) or "
                           "dpace (D-PACE: by the block's running confidence so far; CE only, as speculators after 0.9 "
                           "trains DFlash).")
    dpace_alpha: float = setting(0.5, "dpace: the confidence smoothing constant.", gt=0)
    markov_rank: int = setting(256, "dspark only: 0 disables the Markov head.", ge=0)
    markov_head_type: Literal[MARKOV_HEAD_TYPES] = setting("vanilla", "dspark only.")
    enable_confidence_head: bool = setting(True, "dspark only.")
    confidence_head_with_markov: bool = setting(True)
    confidence_head_alpha: float = setting(1.0, ge=0)
    ttt_steps: int = setting(3, "eagle3: training-time test steps, the drafts it learns to chain (its "
                                "speculative tokens).", ge=1)
    ttt_step_loss_decay: float = setting(1.0, "eagle3: loss weight decay per training-time test step.", gt=0)
    loss_fn: str | None = setting(
        None, 'A loss name or a JSON map of loss names to weights. Default: {"ce": 0.1, "tv": 0.9}; eagle3: kl_div '
              "(speculators' defaults).")
    optimizer: Literal["muon", "adamw"] = setting("muon", "muon: Muon for hidden 2-D weights, AdamW for the rest.")
    muon_ns_dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "Muon's Newton-Schulz dtype. auto: bf16 where its matmuls are fast (CUDA; CPUs with AVX512-BF16 "
                "or AMX), else fp32.")
    autocast: Literal["auto", "bf16", "off"] = setting(
        "auto", "bf16 autocast of forward and loss (weights and optimizer state stay fp32). auto: on CUDA only; a "
                "CPU with AVX512-BF16 or AMX trains ~1.4x faster with bf16 (SmolLM2's drafter: 2.83 -> 1.96 s a step).")
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    scheduler_type: Literal["cosine", "linear", "none"] = setting("cosine")
    scheduler_warmup_ratio: float = setting(0.03, "Fraction of the steps spent warming up.", ge=0)
    max_grad_norm: float = setting(1.0, gt=0)
    num_workers: int = setting(2, "Reader threads.", ge=1, result_neutral=True)
    prefetch_factor: int = setting(4, "Batches read ahead.", ge=1, result_neutral=True)
    keep_in_memory_gib: float = setting(
        2.0, "Keep decoded samples in memory when all of a Zarr store's fit in this many GiB: epochs after the "
             "first and every validation then read nothing (0: always read from the store).", ge=0,
        result_neutral=True)
    log_freq: int = setting(10, "Steps per logged window.", ge=1)
    val_state_gain: bool = setting(
        True, "DFlash family: at each validation also score the blocks with the context states zeroed and with "
              "another sample's, drafts chained as decoding does; logs each one's match per position and the state "
              "gain (val state_gain_pos*_match, state_gain_tau). Costs three forwards per validation batch.")
    seed: int = setting(0)
    device: str = setting("auto", "auto, cpu or cuda.", result_neutral=True)
    max_steps: int | None = setting(None, "Stop after this many steps (resumable).", ge=1, result_neutral=True)
    on_damaged: Literal["skip", "raise"] = setting(
        "skip", "A sample failing its checksum (or whose chunk is lost): skip it, named at the end, or stop.",
        result_neutral=True)
    # --from mooncake, under the seed's flag names
    live: LiveConfig = setting(factory=LiveConfig, prefixed=False, result_neutral=True)
    # --logger, as speculators names it
    tracking: TrackingConfig = setting(factory=TrackingConfig, prefixed=False, result_neutral=True)

    def __post_init__(self):
        if self.speculator_type not in KINDS:  # validate() says so
            return
        kind = KINDS[self.speculator_type]
        if self.sample_from_anchor is None:  # resolved at once: a run's record holds the layout it trained
            self.sample_from_anchor = kind.sample_from_anchor
        if self.loss_fn is None:
            self.loss_fn = kind.default_loss

    def validate(self) -> TrainConfig:
        check_settings(self)
        self.tracking.trackers()
        if self.total_seq_len < 2 * self.block_size:
            raise InputError(f"--total-seq-len {self.total_seq_len} is shorter than two blocks of "
                             f"--block-size {self.block_size}", f"use --total-seq-len >= {2 * self.block_size}")
        if not self.sample_from_anchor and self.block_size < 2:
            raise InputError(f"--no-sample-from-anchor with --block-size {self.block_size} drafts no token "
                             "(slot 0 is the anchor)", "use --block-size >= 2")
        if not 0 < self.train_data_ratio < 1:
            raise InputError(f"--train-data-ratio {self.train_data_ratio} must be in (0, 1)",
                             "e.g. 0.9 keeps 10% for validation")
        if self.checkpoint_freq > max(1, self.epochs):
            raise InputError(f"--checkpoint-freq {self.checkpoint_freq} must be a positive fraction of an epoch",
                             "e.g. 0.5 checkpoints twice per epoch")
        if not self.scheduler_warmup_ratio < 1:
            raise InputError(f"--scheduler-warmup-ratio {self.scheduler_warmup_ratio} leaves no steps after warm-up",
                             "use a fraction below 1, e.g. 0.03")
        KINDS[self.speculator_type].check(self)  # what the kind itself cannot do
        try:
            check_loss_fn(self.loss_fn)
        except ValueError as e:
            raise InputError(f"--loss-fn {self.loss_fn!r}: {e}", 'e.g. --loss-fn \'{"ce": 0.1, "tv": 0.9}\'') from None
        loss = self.loss_fn or KINDS[self.speculator_type].default_loss
        reads = KINDS[self.speculator_type].reads  # a kind that never reads the setting (EAGLE-3) is not held to it
        ce_alone = loss == "ce" or loss not in LOSS_FNS and set(json.loads(loss)) == {"ce"}
        if "per_position_loss_weight" in reads and self.per_position_loss_weight == "dpace" and not ce_alone:
            # D-PACE reads each term's elementwise loss as a CE (its confidence is exp(-loss))
            raise InputError(f"--per-position-loss-weight dpace weighs positions by the CE's own confidence, and "
                             f"--loss-fn {loss} is not CE alone", "pass --loss-fn ce")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "the run's config") -> TrainConfig:
        return build(cls, d, where)

    @classmethod
    def load(cls, run: Path) -> TrainConfig:
        rec = read_run_record(Path(run))
        if rec is None:
            raise InputError(f"{run} is not a dspark run folder (no config.json)",
                             "pass the --save-path of a `dspark train` run")
        return cls.from_dict(rec["train"], f"{Path(run) / 'config.json'} (train)")

    def differences(self, other: TrainConfig) -> list[str]:
        """The settings, other than result-neutral ones, in which `other` differs."""
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in a if k not in RESULT_NEUTRAL and a[k] != b[k])


def check_loss_fn(spec: str) -> None:
    """What speculators' `resolve_loss_config` accepts (a loss name, or a non-empty JSON map of names to numeric
    weights), checked against LOSS_FNS without importing it; ValueError in its words otherwise."""
    if spec in LOSS_FNS:
        return
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError:
        raise ValueError(f"Unknown loss function '{spec}'. Pass a known name ({sorted(LOSS_FNS)}) or a JSON dict, "
                         'e.g. \'{"ce": 0.1, "tv": 0.9}\'.') from None
    if not isinstance(parsed, dict) or not parsed:
        raise ValueError("Loss config must be a non-empty JSON dict mapping loss names to weights, "
                         f'e.g. \'{{"ce": 0.1, "tv": 0.9}}\'. Got: {spec}')
    for name, weight in parsed.items():
        if name not in LOSS_FNS:
            raise ValueError(f"Unknown loss function '{name}' in loss config. Choose from: {sorted(LOSS_FNS)}")
        if not isinstance(weight, (int, float)):
            raise ValueError(f"Loss weight for '{name}' must be a number, got {type(weight).__name__}")


# Top-level keys of `TrainConfig.to_dict()` a resume or replay may change.
RESULT_NEUTRAL = {f.name for f in fields(TrainConfig) if f.metadata["result_neutral"]}


@dataclass
class ReplayConfig:
    """`dspark replay`: retrain a finished run from its record and compare every logged metric."""

    run: str = setting(help="The run folder.", positional=True)
    store: str | None = setting(None, "The run's store, if it moved.")
    tolerance: float = setting(0.0, "Relative/absolute (GPU runs).", ge=0)
    logger: str = setting("jsonl", "Trackers the replay logs to, as `train --logger` (default: none, only its "
                                   "metrics.jsonl).")


def run_schema() -> dict:
    """RUN/config.json, as `Trainer._record` writes it; `train` is held to what `dspark train` accepts."""
    return {"train": mapping(settings_schema(TrainConfig)), "store_fingerprint": text(),
            "prepared_fingerprint": text(), "seed": integer(), "world_size": integer(1), "device": text(),
            "versions": mapping(values=text()),
            "skipped": optional(mapping(values=list_of(integer(0))))}  # pass -> sample ids a live run skipped


def read_run_record(root: Path) -> dict | None:
    """RUN/config.json checked whole (None: there is none, the folder is no run yet)."""
    return read_run(root, run_schema())
