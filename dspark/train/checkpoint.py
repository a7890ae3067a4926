"""Run folder: recorded config, checkpoints (speculators format + trainer state), pointers.

    RUN/.lock                       locked (flock) by the process writing the run; names it
    RUN/config.json                 resolved config, store fingerprint, seeds, versions
    RUN/metrics.jsonl               every logged metric
    RUN/checkpoints/step-000040/    config.json + model.safetensors (speculators) + trainer_state.pt
                                    + checksums.json (written last)
    RUN/latest, RUN/best            relative symlinks to checkpoints, swapped atomically

One process writes a run folder: `train` holds an OS lock on RUN/.lock from start to end, and a second
one is refused in one line naming the holder. The kernel drops a lock when its holder exits, kill -9
included, so a lock is never stale. Readers (`eval`, `export`, `decode`) take no lock and need none: a
checkpoint is written as .step-N.<pid>-<random>.tmp (dspark.core.fsio) and renamed into place whole, a run
never rewrites one, and a `.tmp` folder is refused. `latest` is where the last save pointed, not the
truth: a rerun resumes from the newest checkpoint of the run, so a lost or dangling `latest` (or a kill
between a checkpoint's rename and the move of `latest`) neither restarts the run over its checkpoints
nor skips one.

checksums.json holds each file's size and xxh3-128, and every load checks them: a truncated or edited
file is one line, not a traceback or a silently different model. They catch damage, not forgery
(whoever can edit a file can edit its checksums). Checkpoints of earlier dspark versions have none;
they load after the checks their files allow without (see `verify_checkpoint`).

trainer_state.pt holds only what `torch.load(weights_only=True)` accepts (tensors, dicts, lists,
numbers, strings): a run folder may come from anyone, and a full unpickler would run any code a
crafted file names. Loading refuses anything else with one line.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark.core.errors import CheckpointError, InputError
from dspark.core.files import FileRefused, file_xxh3, read_bounded
from dspark.core.fsio import publishing, remove_leftovers, replace_symlink, write_atomic
from dspark.core.jsonio import dump_json
from dspark.core.outputs import Lock
from dspark.train.config import read_run_record

if TYPE_CHECKING:  # the functions that need torch import it: checking a checkpoint or a run folder loads none
    import torch


def rng_state() -> dict:
    """Every RNG a step draws from, as tensors, ints and strings (weights_only-loadable)."""
    import torch

    np_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(),
            "numpy": {"bit_generator": np_state["bit_generator"], "pos": np_state["state"]["pos"],
                      "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                      "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]},
            "python": list(random.getstate()),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    import torch

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
    return first_line(e), False


class RunLock(Lock):
    """The exclusive OS lock (flock) on RUN/.lock, held until `release()` or the end of the process."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root / ".lock", f"run folder {root}",
                         "wait for it to finish or stop it (its lock goes with it, even on kill -9), "
                         "or use another --save-path", CheckpointError)


CHECKSUMS = "checksums.json"
SMALL_FILE = 1 << 20  # config.json, checksums.json: far smaller; a larger one is damage, not read whole


def write_checksums(folder: Path) -> None:
    """Every file's size and checksum; written last, inside the temp folder a save renames into place whole."""
    files = {p.name: {"size": p.stat().st_size, "xxh3_128": file_xxh3(p)} for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / CHECKSUMS).write_text(json.dumps({"files": files}, indent=1))


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def damaged(ckpt: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {ckpt} is damaged: {what}",
                           "restore it from a copy or use another checkpoint; a resumed run needs it deleted: "
                           "training then continues from the newest intact checkpoint")


def _small_json(ckpt: Path, name: str):
    try:
        raw = read_bounded(ckpt / name, SMALL_FILE)
    except (OSError, FileRefused):
        raise damaged(ckpt, f"{name} is not a file of at most {SMALL_FILE} bytes") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise damaged(ckpt, f"{name} is not JSON ({first_line(e)})") from None


def read_config(ckpt: Path) -> dict:
    """The checkpoint's config.json, checked to hold what export and eval read of it."""
    config = _small_json(ckpt, "config.json")
    try:
        spec = config["speculators_config"]
        ok = isinstance(spec["verifier"], dict) and isinstance(spec["proposal_methods"][0]["speculative_tokens"], int)
    except (KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise damaged(ckpt, "config.json is not a speculators drafter config (no speculators_config with a "
                            "verifier and a proposal method's speculative_tokens)")
    return config


def weight_names(ckpt: Path) -> set[str]:
    """The tensors in model.safetensors; safetensors checks that its header covers the file exactly, so a
    truncated or padded file fails here."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(ckpt / "model.safetensors", framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise damaged(ckpt, f"model.safetensors is not a whole safetensors file ({first_line(e)})") from None


def check_weight_names(model, names: set[str], ckpt: Path) -> None:
    """`names` (a checkpoint's tensors) must be every tensor `model` saves, and nothing else: a load that lacks
    some leaves them at their initial values without a word (a resume that silently diverges)."""
    own = set(model.state_dict())
    borrowed = set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # the verifier's: never saved
    missing, unexpected = sorted(own - borrowed - names), sorted(names - own)
    problems = [f"lacks {len(missing)} tensors of this drafter ({_few(missing)})"] if missing else []
    if unexpected:
        problems.append(f"holds {len(unexpected)} tensors this drafter does not have ({_few(unexpected)})")
    if problems:
        raise damaged(ckpt, "model.safetensors " + " and ".join(problems))


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def load_weights(model, ckpt: Path, device: torch.device) -> None:
    """`ckpt`'s model.safetensors into `model`: every tensor it saves, each of its shape (or one line)."""
    from safetensors.torch import load_file

    check_weight_names(model, weight_names(ckpt), ckpt)
    try:  # not strict: the verifier's borrowed tensors are not in the file (check_weight_names knows them)
        model.load_state_dict(load_file(ckpt / "model.safetensors", device=str(device)), strict=False)
    except RuntimeError as e:  # torch lists each tensor whose shape differs, one a line
        lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line] or [first_line(e)]
        raise damaged(ckpt, f"model.safetensors does not fit this drafter ({lines[0]})") from None


def verify_checkpoint(ckpt: Path) -> bool:
    """Check `ckpt`'s files against its checksums.json (sizes first, so a file swapped for a device is not
    read), or raise one line naming the first that differs. Without checksums.json (a checkpoint of an
    earlier dspark, or an export) check what the files allow: config.json and the safetensors structure.
    Returns whether the checksums were there."""
    if not (ckpt / CHECKSUMS).exists():
        read_config(ckpt)
        weight_names(ckpt)
        return False
    try:
        files = [(name, int(f["size"]), str(f["xxh3_128"]))
                 for name, f in _small_json(ckpt, CHECKSUMS)["files"].items() if Path(name).name == name]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise damaged(ckpt, f"{CHECKSUMS} does not list files with their size and xxh3_128") from None
    for name, size, digest in files:
        path = ckpt / name
        if not path.is_file():
            raise damaged(ckpt, f"{name} is missing (or not a regular file)")
        if path.stat().st_size != size:
            raise damaged(ckpt, f"{name} is {path.stat().st_size} bytes, {size} when saved")
        if file_xxh3(path) != digest:
            raise damaged(ckpt, f"{name} differs from what was saved (its checksum)")
    return True


def unverified_note(ckpt: Path) -> str:
    return f"note: {ckpt} has no {CHECKSUMS} (saved by an earlier dspark): its files are not verified"


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config_path = self.root / "config.json"
        self.metrics_path = self.root / "metrics.jsonl"

    def checkpoint(self, which: str = "latest") -> Path | None:
        link = self.root / which
        return link.resolve() if link.exists() else None

    def lock(self) -> RunLock:
        """One writer per run folder: a second one is refused, naming this one."""
        return RunLock(self.root)

    def saved(self) -> list[Path]:
        """This run's checkpoints, oldest first: the step-N folders a save renamed into place (never a .tmp)."""
        folder = self.root / "checkpoints"
        steps = [p for p in folder.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
        return sorted(steps, key=lambda p: int(p.name[len("step-"):]))

    def resume_point(self, repair: bool) -> tuple[Path | None, list[str]]:
        """The checkpoint a rerun continues from (None: a fresh start), verified, and notes to print.

        It is the newest checkpoint of this run, wherever `latest` points: a lost or dangling `latest`, or a
        kill between a checkpoint's rename and the move of `latest`, then neither restarts the run over its
        checkpoints nor skips one; `repair` (the one process that writes) moves `latest` to it. A `latest`
        naming another run's checkpoint is refused: it would mix two runs.
        """
        link = self.root / "latest"
        pointed = link.resolve() if link.is_symlink() or link.exists() else None
        if pointed is not None and pointed.parent != (self.root / "checkpoints").resolve():
            raise CheckpointError(f"{link} points outside this run, at {pointed}",
                                  f"point it at a checkpoint of this run (`ln -sfn checkpoints/step-N {link}`) or "
                                  "delete it: training then resumes from the newest checkpoint of this run")
        saved = self.saved()
        if not saved:
            return None, []
        newest = saved[-1]
        notes = [] if verify_checkpoint(newest) else [unverified_note(newest)]
        if pointed != newest.resolve():
            why = ("is missing" if pointed is None else f"points at {pointed.name}, which does not exist"
                   if not pointed.exists() else f"points at {pointed.name}, older (a save was cut short)")
            notes.append(f"{link} {why}: resuming from {newest.name}, the newest checkpoint of this run")
            if repair:
                self._point("latest", newest)
        return newest, notes

    def record(self) -> dict | None:
        """config.json, checked against its schema (None: no run was started here yet)."""
        return read_run_record(self.root)

    def write_record(self, record: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config_path, dump_json(record, indent=2, default=str))

    def _point(self, name: str, target: Path) -> None:
        replace_symlink(self.root / name, os.path.relpath(target, self.root))

    def save(self, step: int, model, trainer_state: dict, best: bool) -> Path:
        """Write the checkpoint to a temp folder, rename it in place, then move `latest` (and `best`).

        A failed write (a full disk) removes the temp folder and leaves `latest` where it was. An existing
        checkpoint is never replaced: readers rely on it, and a resume continues past the newest one.
        """
        import torch

        final = self.root / "checkpoints" / f"step-{step:06d}"
        if final.exists():
            raise CheckpointError(f"checkpoint {final} already exists, and a run never overwrites its checkpoints",
                                  "rerun the same command: training resumes from the newest checkpoint of the run")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(final, sole_writer=True)  # of a save killed mid-way; the run lock makes us the writer
            shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)  # one of dspark before fsio
            with publishing(final) as tmp:  # a failed write removes the temp folder
                model.save_pretrained(tmp)
                with open(tmp / "trainer_state.pt", "wb") as f:  # a file object: ENOSPC stays visible as the cause
                    torch.save(trainer_state, f)
                write_checksums(tmp)
            self._point("latest", final)
            if best:
                self._point("best", final)
        except Exception as e:  # torch, safetensors and the OS each word a failed write differently
            reason, full = _write_failure(e)
            prev = self.checkpoint("latest")
            resume = (f"training resumes from the last checkpoint {prev}" if prev
                      else "training starts over (no checkpoint yet)")
            raise CheckpointError(f"could not save checkpoint {final.name} to {final.parent}: {reason}",
                                  f"{'free disk space' if full else 'fix that'} and rerun the same command: "
                                  f"{resume}") from e
        return final


def require_checkpoint(path: str | Path) -> Path:
    """A speculators-format checkpoint folder, resolved (follows `latest`/`best`) and verified, or one line."""
    ckpt = Path(path).resolve()
    if ckpt.name.endswith(".tmp"):
        raise InputError(f"{path} is a checkpoint still being written, or left by a save cut short",
                         "pass a checkpoint folder, e.g. RUN/latest or RUN/best")
    if not (ckpt / "config.json").exists() or not (ckpt / "model.safetensors").exists():
        raise InputError(f"{path} is not a checkpoint (config.json + model.safetensors)",
                         "pass a checkpoint folder, e.g. RUN/latest or RUN/best")
    if not verify_checkpoint(ckpt) and (ckpt / "trainer_state.pt").exists():  # an export has no checksums, by design
        print(unverified_note(ckpt), file=sys.stderr)
    return ckpt


# Checkpoints of earlier dspark versions hold numpy's RNG key as a uint32 ndarray. Rebuilding a
# plain array calls nothing else, so these names are safe to allow; nothing more is. numpy 2
# renamed numpy.core to numpy._core: a file names the one it was written with.
_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
_LEGACY_NUMPY = [np.dtype, np.dtypes.UInt32DType, np.ndarray,
                 (_reconstruct, "numpy._core.multiarray._reconstruct"),
                 (_reconstruct, "numpy.core.multiarray._reconstruct")]


def load_trainer_state(ckpt: Path) -> dict:
    import torch

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
                              f"do not resume from a run folder you did not write; delete {ckpt} (training then "
                              "resumes from the newest checkpoint before it), or use a new --save-path") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise damaged(ckpt, f"trainer_state.pt: {first_line(e)}") from None


def weight_count(weights: Path) -> int | None:
    """The parameters in a drafter's weights file (its vocabulary maps d2t/t2d are not parameters)."""
    try:
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    except Exception:  # noqa: BLE001  (a figure for the card, never a reason to fail the export)
        return None
