"""Run folder: recorded config, checkpoints (speculators format + trainer state), pointers.

    RUN/config.json                 resolved config, store fingerprint, seeds, versions
    RUN/metrics.jsonl               every logged metric
    RUN/checkpoints/step-000040/    config.json + model.safetensors (speculators) + trainer_state.pt
    RUN/latest, RUN/best            relative symlinks to checkpoints, swapped atomically
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from dspark.errors import InputError


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config_path = self.root / "config.json"
        self.metrics_path = self.root / "metrics.jsonl"

    def checkpoint(self, which: str = "latest") -> Path | None:
        link = self.root / which
        return link.resolve() if link.exists() else None

    def record(self) -> dict | None:
        return json.loads(self.config_path.read_text()) if self.config_path.exists() else None

    def write_record(self, record: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=str))
        tmp.replace(self.config_path)

    def _point(self, name: str, target: Path) -> None:
        tmp = self.root / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(target, self.root), tmp)
        os.replace(tmp, self.root / name)

    def save(self, step: int, model, trainer_state: dict, best: bool) -> Path:
        """Write the checkpoint to a temp folder, rename it in place, then move `latest` (and `best`)."""
        final = self.root / "checkpoints" / f"step-{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._point("latest", final)
        if best:
            self._point("best", final)
        return final


def require_checkpoint(path: str | Path) -> Path:
    """A speculators-format checkpoint folder, resolved (follows `latest`/`best`), or a clear error."""
    ckpt = Path(path).resolve()
    if not (ckpt / "config.json").exists() or not (ckpt / "model.safetensors").exists():
        raise InputError(f"{path} is not a checkpoint (config.json + model.safetensors)",
                         "pass a checkpoint folder, e.g. RUN/latest or RUN/best")
    return ckpt


def load_trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer_state.pt"
    if not path.exists():
        raise InputError(f"checkpoint {ckpt} has no trainer_state.pt", "point at a checkpoint of `dspark train`")
    return torch.load(path, weights_only=False)
