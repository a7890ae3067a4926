"""The training run's configuration: one dataclass, recorded in the run folder, replayed from it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspark.errors import InputError

# Keys that may change when resuming or replaying without changing the result.
# The source too: a live run's cache holds exactly the samples it trained on.
# So is the damage policy: on an intact store it never acts, and what it skips is named.
RESULT_NEUTRAL = {"num_workers", "prefetch_factor", "max_steps", "save_path", "device", "source", "live",
                  "on_damaged"}


@dataclass
class TrainConfig:
    store: str
    data_path: str
    verifier_name_or_path: str
    save_path: str
    target_layer_ids: list[int]
    source: str = "zarr"
    trust_remote_code: bool = False
    draft_config: str | None = None
    num_layers: int = 1
    draft_vocab_size: int | None = None
    mask_token_id: int | None = None
    epochs: int = 1
    checkpoint_freq: float = 1.0
    total_seq_len: int = 2048
    train_data_ratio: float = 0.9
    speculator_type: str = "dspark"
    block_size: int = 8
    max_anchors: int = 512
    dflash_decay_gamma: float = 4.0
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_head_alpha: float = 1.0
    loss_fn: str = '{"ce": 0.1, "tv": 0.9}'
    optimizer: str = "muon"
    lr: float = 1e-3
    weight_decay: float = 0.0
    scheduler_type: str = "cosine"
    scheduler_warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    num_workers: int = 2
    prefetch_factor: int = 4
    log_freq: int = 10
    seed: int = 0
    device: str = "auto"
    max_steps: int | None = None
    on_damaged: str = "skip"  # a sample failing its checksum: skip it (named at the end) or raise
    live: dict = field(default_factory=dict)  # LiveConfig fields for --from mooncake

    def validate(self) -> TrainConfig:
        if self.speculator_type != "dspark":
            raise InputError(f"--speculator-type {self.speculator_type} is not supported", "use dspark")
        if self.total_seq_len < 2 * self.block_size:
            raise InputError(f"--total-seq-len {self.total_seq_len} is shorter than two blocks of "
                             f"--block-size {self.block_size}", f"use --total-seq-len >= {2 * self.block_size}")
        if not 0 < self.train_data_ratio < 1:
            raise InputError(f"--train-data-ratio {self.train_data_ratio} must be in (0, 1)",
                             "e.g. 0.9 keeps 10% for validation")
        if not 0 < self.checkpoint_freq <= 1 * max(1, self.epochs):
            raise InputError(f"--checkpoint-freq {self.checkpoint_freq} must be a positive fraction of an epoch",
                             "e.g. 0.5 checkpoints twice per epoch")
        if self.confidence_head_with_markov and self.enable_confidence_head and self.markov_rank <= 0:
            raise InputError("--confidence-head-with-markov needs a Markov head, but --markov-rank is 0",
                             "add --no-confidence-head-with-markov, or set --markov-rank > 0")
        if self.on_damaged not in ("skip", "raise"):
            raise InputError(f"--on-damaged {self.on_damaged} is not supported", "use skip or raise")
        if self.optimizer not in ("muon", "adamw"):
            raise InputError(f"--optimizer {self.optimizer} is not supported", "use muon or adamw")
        if self.scheduler_type not in ("cosine", "linear", "none"):
            raise InputError(f"--scheduler-type {self.scheduler_type} is not supported",
                             "use cosine, linear or none")
        try:
            json.loads(self.loss_fn) if self.loss_fn.strip().startswith("{") else None
        except json.JSONDecodeError:
            raise InputError(f"--loss-fn {self.loss_fn!r} is not valid JSON", 'e.g. \'{"ce":0.1,"tv":0.9}\'') from None
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, run: Path) -> TrainConfig:
        path = Path(run) / "config.json"
        if not path.exists():
            raise InputError(f"{run} is not a dspark run folder (no config.json)",
                             "pass the --save-path of a `dspark train` run")
        return cls.from_dict(json.loads(path.read_text())["train"])

    def differences(self, other: TrainConfig) -> list[str]:
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in a if k not in RESULT_NEUTRAL and a[k] != b[k])
