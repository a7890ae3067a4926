"""One class per experiment tracker, found by its `--logger` name (config.py's TRACKERS).

Each opens (or reopens, from its identity in RUN/trackers.json) one tracker run, logs scalars at training
steps, logs eval results and their plots, says which step it last holds per key, and closes. Each runs on
its own thread (run.py), which turns any exception into a one-time warning.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import ClassVar

from dspark.tracking.config import TrackingConfig

def _last_steps(pairs) -> dict[str, int]:
    """The highest step per key from (key, step) pairs such as (`train/loss`, 40).

    Per key, not per record: a kill between two keys of one step leaves that step half logged.
    """
    last: dict[str, int] = {}
    for key, step in pairs:
        last[key] = max(last.get(key, -1), int(step))
    return last


class Backend:
    name: ClassVar[str]
    module: ClassVar[str]  # what must be importable (its extra is dspark[name])

    def __init__(self, root: Path, cfg: TrackingConfig | None, identity: dict | None):
        """`cfg` None: reopen the run `identity` names (eval results); it must exist."""
        self.root = root.resolve()
        self.cfg = cfg or TrackingConfig()
        self.identity = dict(identity or {})
        self.log_checkpoints = bool(cfg and cfg.log_checkpoints)
        self.run_name = self.identity.get("name") or self.cfg.run_name or self.root.name

    def start(self, params: dict | None, tags: dict | None) -> dict:
        """Open the run (params and tags only on a new one); the identity that reopens it."""
        raise NotImplementedError

    def last_steps(self) -> dict[str, int]:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_results(self, values: dict[str, float], step: int, images: list[Path]) -> None:
        self.log(values, step)

    def log_artifact(self, folder: Path) -> None:
        """A checkpoint folder; trackers without an artifact store ignore it (the flag's help says which)."""

    def close(self) -> None:
        pass


class TensorBoard(Backend):
    name = module = "tensorboard"

    def start(self, params, tags):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(self.identity.get("log_dir") or self.root / "tensorboard")
        fresh = not self.dir.exists()
        self.writer = SummaryWriter(str(self.dir), flush_secs=10)
        if fresh and params is not None:
            self.writer.add_text("config", _code_block(params), 0)
            self.writer.add_text("tags", _code_block(tags or {}), 0)
        return {"log_dir": str(self.dir)}

    def last_steps(self):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(self.dir), size_guidance={"scalars": 0})
        acc.Reload()
        return _last_steps((tag, e.step) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))

    def log(self, values, step):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_results(self, values, step, images):
        import numpy as np
        from PIL import Image

        for path in images:
            self.writer.add_image(f"eval/{path.stem}", np.asarray(Image.open(path).convert("RGB")), step,
                                  dataformats="HWC")
        self.log(values, step)

    def close(self):
        self.writer.close()


class MLflow(Backend):
    name = module = "mlflow"

    def start(self, params, tags):
        self.uri = self.identity.get("tracking_uri") or self.cfg.tracking_uri or (self.root / "mlruns").as_uri()
        if self.uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch; it is the offline one
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id = self.identity.get("run_id")
        if self.run_id is None:
            project = self.cfg.tracking_project
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            self.run_id = self.client.create_run(exp_id, run_name=self.run_name,
                                                 tags={k: str(v) for k, v in (tags or {}).items()}).info.run_id
            self._params(params or {})
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        return {"tracking_uri": self.uri, "run_id": self.run_id, "name": self.run_name}

    def _params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]  # MLflow's limits: 6000 chars, 100 a call
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def last_steps(self):
        metrics = self.client.get_run(self.run_id).data.metrics
        return _last_steps((k, m.step) for k in metrics for m in self.client.get_metric_history(self.run_id, k))

    def log(self, values, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_results(self, values, step, images):
        self.log(values, step)
        for path in images:
            self._artifacts().log_artifact(str(path), f"eval/step-{step:06d}")

    def log_artifact(self, folder):
        self._artifacts().log_artifacts(str(folder), f"checkpoints/{folder.name}")

    def _artifacts(self):
        """Where the run's artifacts go. A file store records its runs' artifact folders as absolute paths, so
        in a copied or moved run folder they would land in the original's: the run's own store (RUN/mlruns)
        keeps them beside its metrics, where MLflow's layout puts them."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
        from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

        info, own = self.client.get_run(self.run_id).info, self.root / "mlruns"
        if self.uri != own.as_uri():
            return get_artifact_repository(info.artifact_uri)
        return LocalArtifactRepository((own / info.experiment_id / self.run_id / "artifacts").as_uri())

    def close(self):
        self.client.set_terminated(self.run_id)


class Wandb(Backend):
    name = module = "wandb"

    def start(self, params, tags):
        os.environ.setdefault("WANDB_SILENT", "true")  # its banners and integration tips would bury our progress
        import wandb

        self.run_id = self.identity.get("id") or new_id()
        self.project = self.identity.get("project") or self.cfg.tracking_project
        self.dir = Path(self.identity.get("dir") or self.root)
        self.mode = os.environ.get("WANDB_MODE", "offline")  # offline-first; WANDB_MODE=online syncs as it goes
        config = None if params is None else {**params, **{f"tags.{k}": v for k, v in (tags or {}).items()}}
        self.run = wandb.init(dir=str(self.dir), project=self.project, name=self.run_name, id=self.run_id,
                              resume="allow", mode=self.mode, config=config,
                              settings=wandb.Settings(console="off", silent=True))
        # eval results belong to a checkpoint's step, which may lie behind the run's: their own step axis
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        return {"id": self.run_id, "project": self.project, "dir": str(self.dir), "name": self.run_name}

    def last_steps(self):
        # Each session writes its own run-ID.wandb (in offline-run-*-ID, or run-*-ID when online)
        files = self.dir.glob(f"wandb/*-{self.run_id}/run-{self.run_id}.wandb")
        return _last_steps((k, row["_step"]) for f in files for row in wandb_history(f)
                            for k in row if not k.startswith("_"))

    def log(self, values, step):
        self.run.log(values, step=step)

    def log_results(self, values, step, images):
        import wandb

        self.run.log({**values, **{f"eval/{p.stem}": wandb.Image(str(p)) for p in images}, "eval/step": step})

    def log_artifact(self, folder):
        import wandb

        art = wandb.Artifact(f"{self.run_id}-{folder.name}", type="model")
        art.add_dir(str(folder))
        self.run.log_artifact(art)

    def close(self):
        self.run.finish()


def wandb_history(path: Path) -> list[dict]:
    """The history rows of one .wandb file (wandb 0.31 ships no reader): LevelDB-log records of wandb's protobuf.

    A file cut short (a kill: wandb writes whole 32 KiB blocks) yields the rows before the cut.
    """
    import json
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    block, header = 32768, 7
    crcs = {t: zlib.crc32(bytes([t])) for t in range(1, 5)}  # full, first, middle, last
    buf = path.read_bytes()
    rows, parts, pos = [], [], header  # the file's own 7-byte header: ":W&B", version, 0xBEE1
    while True:
        if block - pos % block < header:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        if pos + header > len(buf):
            return rows
        crc, n, kind = struct.unpack("<IHB", buf[pos:pos + header])
        data = buf[pos + header:pos + header + n]
        if kind not in crcs or len(data) < n or zlib.crc32(data, crcs[kind]) != crc:
            return rows
        pos += header + n
        parts = [data] if kind in (1, 2) else [*parts, data]
        if kind in (2, 3):
            continue
        rec = pb.Record()
        rec.ParseFromString(b"".join(parts))
        if rec.WhichOneof("record_type") == "history":
            row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
            row.setdefault("_step", rec.history.step.num)
            rows.append(row)


class Trackio(Backend):
    name = module = "trackio"

    def start(self, params, tags):
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        self.project = self.identity.get("project") or self.cfg.tracking_project
        name = self.identity.get("name")
        if not self.identity:  # trackio resumes by name: a new run never joins another folder's run of that name
            taken = set(SQLiteStorage.get_runs(self.project))
            name = self.run_name if self.run_name not in taken else f"{self.run_name}-{new_id()}"
        self.run_name = name
        config = ({k: v for k, v in SQLiteStorage.get_run_config(self.project, name).items() if not k.startswith("_")}
                  if params is None  # trackio keeps the config of a run's latest start: reopening keeps it
                  else {**params, **{f"tags.{k}": v for k, v in (tags or {}).items()}})
        with _stdout_to_stderr():
            self.run = trackio.init(project=self.project, name=name, config=config, resume="allow",
                                    auto_log_cpu=False, auto_log_gpu=False)
        return {"project": self.project, "name": name}

    def last_steps(self):
        from trackio.sqlite_storage import SQLiteStorage

        return _last_steps((k, row["step"]) for row in SQLiteStorage.get_logs(self.project, self.run_name)
                            for k in row if k not in ("step", "timestamp"))

    def log(self, values, step):
        self.run.log(values, step=step)

    def log_results(self, values, step, images):
        import trackio

        self.run.log({**values, **{f"eval/{p.stem}": trackio.Image(str(p)) for p in images}}, step=step)

    def log_artifact(self, folder):
        with _stdout_to_stderr():
            self.run.log_artifact(str(folder), name=f"{self.run_name}-{folder.name}", type="model")

    def close(self):
        with _stdout_to_stderr():
            self.run.finish()


def _stdout_to_stderr():
    """trackio prints its notes on stdout, where `dspark train` prints its JSON result."""
    import contextlib
    import sys

    return contextlib.redirect_stdout(sys.stderr)


def _code_block(d: dict) -> str:
    from dspark.core.jsonio import dump_json

    return "```\n" + dump_json(d, indent=2, default=str) + "\n```"


def new_id() -> str:
    return secrets.token_hex(4)

