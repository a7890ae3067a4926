"""Run folder: recorded config, checkpoints (speculators format + trainer state), pointers.

    RUN/config.json                 resolved config, store fingerprint, seeds, versions
    RUN/metrics.jsonl               every logged metric
    RUN/checkpoints/step-000040/    config.json + model.safetensors (speculators) + trainer_state.pt
    RUN/latest, RUN/best            relative symlinks to checkpoints, swapped atomically

trainer_state.pt holds only what `torch.load(weights_only=True)` accepts (tensors, dicts, lists,
numbers, strings): a run folder may come from anyone, and a full unpickler would run any code a
crafted file names. Loading refuses anything else with one line.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from dspark.errors import CheckpointError, InputError


def rng_state() -> dict:
    """Every RNG a step draws from, as tensors, ints and strings (weights_only-loadable)."""
    np_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(),
            "numpy": {"bit_generator": np_state["bit_generator"], "pos": np_state["state"]["pos"],
                      "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                      "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]},
            "python": list(random.getstate()),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    n = s["numpy"]
    if isinstance(n, dict):
        np.random.set_state({"bit_generator": n["bit_generator"], "has_gauss": n["has_gauss"], "gauss": n["gauss"],
                             "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]}})
    else:  # checkpoints of earlier dspark versions: numpy's legacy tuple
        np.random.set_state(n)
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _write_failure(e: BaseException) -> tuple[str, bool]:
    """The OS's reason behind a failed write, and whether the disk is full.

    torch.save reports ENOSPC as a RuntimeError ("unexpected pos ...") with the OSError as its
    context; safetensors as a SafetensorError whose text ends in "(os error 28)".
    """
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.strerror or str(cause), cause.errno == errno.ENOSPC
        cause = cause.__cause__ or cause.__context__
    text = str(e)
    m = re.search(r"(?:I/O error: )?([^:]*) \(os error (\d+)\)", text)
    if m:
        return m.group(1).strip(), int(m.group(2)) == errno.ENOSPC
    return (text.splitlines() or [type(e).__name__])[0], False


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
        """Write the checkpoint to a temp folder, rename it in place, then move `latest` (and `best`).

        A failed write (a full disk) removes the temp folder and leaves `latest` where it was.
        """
        final = self.root / "checkpoints" / f"step-{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            model.save_pretrained(tmp)
            with open(tmp / "trainer_state.pt", "wb") as f:  # a file object: ENOSPC stays visible as the cause
                torch.save(trainer_state, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._point("latest", final)
            if best:
                self._point("best", final)
        except Exception as e:  # torch, safetensors and the OS each word a failed write differently
            reason, full = _write_failure(e)
            shutil.rmtree(tmp, ignore_errors=True)
            prev = self.checkpoint("latest")
            resume = (f"training resumes from the last checkpoint {prev}" if prev
                      else "training starts over (no checkpoint yet)")
            raise CheckpointError(f"could not save checkpoint {final.name} to {final.parent}: {reason}",
                                  f"{'free disk space' if full else 'fix that'} and rerun the same command: "
                                  f"{resume}") from e
        return final


def require_checkpoint(path: str | Path) -> Path:
    """A speculators-format checkpoint folder, resolved (follows `latest`/`best`), or a clear error."""
    ckpt = Path(path).resolve()
    if not (ckpt / "config.json").exists() or not (ckpt / "model.safetensors").exists():
        raise InputError(f"{path} is not a checkpoint (config.json + model.safetensors)",
                         "pass a checkpoint folder, e.g. RUN/latest or RUN/best")
    return ckpt


# Checkpoints of earlier dspark versions hold numpy's RNG key as a uint32 ndarray. Rebuilding a
# plain array calls nothing else, so these names are safe to allow; nothing more is. numpy 2
# renamed numpy.core to numpy._core: a file names the one it was written with.
_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
_LEGACY_NUMPY = [np.dtype, np.dtypes.UInt32DType, np.ndarray,
                 (_reconstruct, "numpy._core.multiarray._reconstruct"),
                 (_reconstruct, "numpy.core.multiarray._reconstruct")]


def load_trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer_state.pt"
    if not path.exists():
        raise InputError(f"checkpoint {ckpt} has no trainer_state.pt", "point at a checkpoint of `dspark train`")
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL (\S+)", str(e))
        what = f"it names {m.group(1)}, which loading would import and call" if m else "it holds more than tensors"
        raise CheckpointError(f"{path} is not a safe checkpoint: {what}",
                              f"do not resume from a run folder you did not write; delete {ckpt} and point "
                              f"{ckpt.parent.parent}/latest at an earlier checkpoint, or use a new --save-path"
                              ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} is damaged: {(str(e).splitlines() or [type(e).__name__])[0]}",
                              f"delete {ckpt} and point {ckpt.parent.parent}/latest at an earlier checkpoint, "
                              "or use a new --save-path") from None
