"""A run's trackers: each started, fed and closed on its own thread, so none ever holds up training.

RUN/trackers.json names each tracker's run (MLflow run id, wandb id, ...), so a resumed `train` and
`dspark eval` log into the runs the first start opened. A tracker says which step it last holds per key;
what it lacks is sent from metrics.jsonl and what it holds is not sent again. After a kill -9 and a resume
it shows one curve with each step once (a resume is deterministic: a step computed again has the same
values, only its timing differs).

A tracker that fails (its server down, its folder full) is named once on stderr and gets nothing more;
training goes on, and metrics.jsonl keeps every metric.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path

from dspark.core.errors import InputError
from dspark.core.fsio import write_atomic
from dspark.core.jsonio import dump_json
from dspark.core.records import mapping, optional, read_record, read_run, settings_schema, text
from dspark.tracking.backends import Backend
from dspark.tracking.config import TRACKERS, TrackingConfig

IDENTITY = "trackers.json"
CLOSE_SECONDS = 60.0  # the most a finished run waits for its trackers to flush


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as tracker scalars: `train/loss`, `train/timing/data_wait_fraction`, `val/...`."""
    flat = {"epoch": record["epoch"], **record["metrics"],
            **{f"{group}/{k}": v for group in ("timing", "live") for k, v in record.get(group, {}).items()}}
    if "damaged_skipped" in record:
        flat["damaged_skipped"] = record["damaged_skipped"]
    return {f"{record['split']}/{k}": float(v) for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}  # None: a non-finite value, not logged


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested settings as `live.mooncake.master`-style keys (how trackers list parameters)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# trackers.json, checked before a tracker reopens a run from it. Places inside the run folder (a tracker's
# `IN_RUN` key) are recorded relative to it, so a copied or moved run logs into its own files, never the
# original's; MLflow's `store` is its file store in the run, `tracking_uri` any other.
IN_RUN = {"tensorboard": "log_dir", "wandb": "dir", "mlflow": "store"}
OLD_PLACE = {"tensorboard": "tensorboard", "wandb": ".", "mlflow": "mlruns"}  # where older dspark put them
IDENTITY_SCHEMA = {
    "tensorboard": optional(mapping({"log_dir": text()})),
    "mlflow": optional(mapping({"run_id": text(), "name": optional(text()), "store": optional(text()),
                                "tracking_uri": optional(text())})),
    "wandb": optional(mapping({"id": text(), "project": text(), "dir": text(), "name": optional(text())})),
    "trackio": optional(mapping({"project": text(), "name": text()}))}
IDENTITY_FIX = ("restore it from a copy of the run, or delete it: the next `dspark train` opens new tracker runs "
                "and sends them the whole history from metrics.jsonl")


def _stored(root: Path) -> dict[str, dict]:
    """trackers.json as written, checked ({}: the run logged to no tracker)."""
    path = root / IDENTITY
    if not path.exists() and not path.is_symlink():
        return {}
    ids = read_record(path, IDENTITY_SCHEMA, IDENTITY_FIX)
    if "mlflow" in ids and not {"store", "tracking_uri"} & set(ids["mlflow"]):
        raise InputError(f"{path}: field mlflow.tracking_uri is missing, expected a string", IDENTITY_FIX)
    return ids


def read_identity(root: Path) -> dict[str, dict]:
    """Each tracker's run as its backend reopens it: places in the run folder made paths in this one."""
    root = Path(root).resolve()
    ids = _stored(root)
    for name, key in IN_RUN.items():
        if name in ids and key in ids[name]:
            ids[name] = {**ids[name], key: _in_run(name, ids[name][key], root)}
    if "store" in ids.get("mlflow", {}):
        ids["mlflow"]["tracking_uri"] = Path(ids["mlflow"].pop("store")).as_uri()
    elif "mlflow" in ids and _was_runs_own_store(root, ids["mlflow"]["tracking_uri"]):
        ids["mlflow"]["tracking_uri"] = (root / "mlruns").as_uri()
    return ids


def _in_run(name: str, recorded: str, root: Path) -> str:
    """A place a tracker keeps in the run folder, as a path in this one. Older dspark recorded it absolute,
    always at one place of the run it was written from (`OLD_PLACE`): in a copy, that place in this run."""
    path = Path(recorded)
    if path.is_absolute() and not path.is_relative_to(root):
        return str(root / OLD_PLACE[name])
    if not (root / path).resolve().is_relative_to(root):
        raise InputError(f"{root / IDENTITY}: field {name}.{IN_RUN[name]} is {recorded!r}, which leads out of the "
                         "run folder, expected a path inside it", IDENTITY_FIX)
    return str(root / path)


def _file_path(uri: str) -> Path | None:
    """The folder a `file:` URI names (None: another kind of URI)."""
    from urllib.parse import unquote, urlparse

    parts = urlparse(uri)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


def _was_runs_own_store(root: Path, uri: str) -> bool:
    """Whether an older dspark's absolute MLflow URI is the default store of the run it was written from
    (RUN/mlruns, no --tracking-uri recorded): then this run's own store is meant."""
    path = _file_path(uri)
    if path is None or path.is_relative_to(root) or path.name != OLD_PLACE["mlflow"]:
        return False
    rec = read_run(root, {"train": mapping({"tracking": optional(mapping(settings_schema(TrackingConfig)))})})
    return rec is not None and rec["train"].get("tracking", {}).get("tracking_uri") is None


def _relative(name: str, identity: dict, root: Path) -> dict:
    """An identity as trackers.json records it: places inside the run folder relative to it."""
    identity, key = dict(identity), IN_RUN.get(name)
    if name == "mlflow":  # its own file store is recorded as `store`; any other store as its URI
        path = _file_path(identity["tracking_uri"])
        if path is not None and path.is_relative_to(root):
            identity.pop("tracking_uri")
            identity[key] = str(path)
    if key in identity and Path(identity[key]).is_relative_to(root):
        identity[key] = os.path.relpath(identity[key], root)
    return identity


def installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name].module) is not None


def require_installed(names: list[str]) -> None:
    for name in names:
        if not installed(name):
            raise InputError(f"--logger {name}: the {TRACKERS[name].module} package is not installed",
                             f"pip install 'dspark[{name}]' (or drop {name} from --logger)")


def results_trackers(ckpt: Path) -> dict[str, dict]:
    """The trackers (checked) that get eval results of checkpoint `ckpt`: its run's; none for a bare checkpoint."""
    return read_identity(ckpt.parent.parent) if re.fullmatch(r"step-\d+", ckpt.name) else {}


def log_results(ckpt: Path, values: dict[str, float], images: list[Path]) -> None:
    """Eval results of a checkpoint into the trackers of its run, at the checkpoint's step (none: nothing)."""
    root, step = ckpt.parent.parent, re.fullmatch(r"step-(\d+)", ckpt.name)
    if not results_trackers(ckpt):  # a bare checkpoint, or a run that logged to no tracker
        return
    tracking = Tracking.for_results(root)
    tracking.results(int(step[1]), values, [p for p in images if p.exists()])
    tracking.close()


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


class Tracking:
    """The trackers of one run folder, each fed from its own queue by its own daemon thread.

    `log`, `artifact` and `results` only enqueue: a tracker waiting on its network costs the training loop,
    and the other trackers, nothing. `close` waits at most CLOSE_SECONDS for what is queued to reach them.
    """

    def __init__(self, root: str | Path, backends: list[Backend], params: dict | None = None,
                 tags: dict | None = None, history: list[dict] = (), kept: str = ""):
        self.root = Path(root)
        self.kept = kept  # what still holds everything when a tracker fails
        self._lock = threading.Lock()  # trackers.json: each feed adds its tracker's run
        self.feeds = [_Feed(self, b, params, tags, list(history)) for b in backends]

    @classmethod
    def for_training(cls, root: str | Path, cfg: TrackingConfig, params: dict, tags: dict,
                     history: list[dict]) -> Tracking:
        """`--logger`'s trackers, continuing the runs trackers.json names; a tracker not installed is one line."""
        names = cfg.trackers()
        require_installed(names)
        ids = read_identity(Path(root))
        recorded = ids.get("mlflow", {}).get("tracking_uri")
        if "mlflow" in names and cfg.tracking_uri and recorded and cfg.tracking_uri != recorded:
            # the run's MLflow run lives in the store it started in: a new store gets a new run, sent everything
            print(f"note: --tracking-uri {cfg.tracking_uri} is not the MLflow store this run logged to ({recorded}): "
                  "a new MLflow run there gets the whole history from metrics.jsonl, and trackers.json now names it",
                  file=sys.stderr, flush=True)
            del ids["mlflow"]
        return cls(root, [TRACKERS[n](Path(root), cfg, ids.get(n)) for n in names], params, tags, history,
                   f"training goes on, and {Path(root) / 'metrics.jsonl'} keeps every metric")

    @classmethod
    def for_results(cls, root: str | Path) -> Tracking:
        """The trackers a run logged to (its trackers.json), for eval results; one not installed here is said."""
        ids = read_identity(Path(root))
        missing = [n for n in ids if n not in TRACKERS or not installed(n)]
        if missing:
            _warn(f"{', '.join(missing)} not installed here: these results are not logged there (pip install "
                  f"'dspark[{missing[0]}]')")
        return cls(root, [TRACKERS[n](Path(root), None, ids[n]) for n in ids if n not in missing],
                   kept="the results stay in their JSON files")

    def log(self, record: dict) -> None:
        """One metrics.jsonl record."""
        self._put(("record", record))

    def artifact(self, folder: Path) -> None:
        """A checkpoint folder (sent where --log-checkpoints asked for it)."""
        self._put(("artifact", folder))

    def results(self, step: int, values: dict[str, float], images: list[Path]) -> None:
        """Eval results of the checkpoint at `step`, and their plots."""
        self._put(("results", (values, step, images)))

    def close(self) -> None:
        self._put(None)
        deadline = time.monotonic() + CLOSE_SECONDS
        for f in self.feeds:
            f.thread.join(max(0.0, deadline - time.monotonic()))
        busy = [f.backend.name for f in self.feeds if f.thread.is_alive()]
        if busy:
            _warn(f"trackers {', '.join(busy)} still busy after {CLOSE_SECONDS:g} s; left unfinished: {self.kept}")

    def remember(self, name: str, identity: dict) -> None:
        """Record a tracker's run in trackers.json, for a resume and for eval."""
        with self._lock:
            root = self.root.resolve()
            write_atomic(root / IDENTITY, dump_json({**_stored(root), name: _relative(name, identity, root)},
                                                   indent=2))

    def _put(self, item) -> None:
        for f in self.feeds:
            if f.ok:
                f.queue.put(item)


class _Feed:
    """One tracker's queue and thread. Once a call to the tracker fails (`ok` False) it gets nothing more."""

    def __init__(self, tracking: Tracking, backend: Backend, params: dict | None, tags: dict | None,
                 history: list[dict]):
        self.tracking, self.backend, self.ok = tracking, backend, True
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, args=(params, tags, history), daemon=True,
                                       name=f"dspark-{backend.name}")
        self.thread.start()

    def _work(self, params: dict | None, tags: dict | None, history: list[dict]) -> None:
        b = self.backend
        identity = self._call("start", b.start, params, tags)
        if self.ok and params is not None:  # a training run (eval only reopens it)
            self.tracking.remember(b.name, identity)
        held = self._call("read back its steps", b.last_steps)
        for record in history:
            self._record(record, held)
        while self.ok and (item := self.queue.get()) is not None:
            kind, payload = item
            if kind == "record":
                self._record(payload, held)
            elif kind == "artifact" and b.log_checkpoints:
                self._call(f"log {payload.name}", b.log_artifact, payload)
            elif kind == "results":
                self._call("log eval results", b.log_results, *payload)
        self._call("finish", b.close)

    def _record(self, record: dict, held: dict[str, int]) -> None:
        """Log the values of one record the tracker does not hold yet."""
        if not self.ok:  # `held` is None when reading it back failed
            return
        step = record["step"]
        values = {k: v for k, v in scalars(record).items() if step > held.get(k, -1)}
        if values:
            self._call(f"log step {step}", self.backend.log, values, step)

    def _call(self, what: str, fn, *args):
        """`fn(*args)`; nothing once the tracker has failed; a failure is one warning."""
        if not self.ok:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  (any tracker failure: the run goes on without it)
            self.ok = False
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            _warn(f"tracker {self.backend.name} could not {what} ({type(e).__name__}: {first}); it gets nothing "
                  f"more from this run: {self.tracking.kept}")
            return None
