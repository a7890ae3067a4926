"""`dspark replay RUN`: retrain from the run's record against its store and compare every metric.

The record (RUN/config.json) holds the resolved config and the store's content
fingerprint. A replay refuses a store whose fingerprint differs (the result
would differ for a known reason), retrains into RUN/replays/<n>, and compares
each logged record's metrics: exactly by default (on CPU a replay is bit for
bit), or within --tolerance for GPU runs.

A live run records the samples it skipped, pass by pass (its source was down); its
cache, which the replay reads, holds them when they were fetched later, so the replay
leaves the same ones out where the run did, and says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

from dspark.core.errors import InputError, StoreMismatch
from dspark.train.checkpoint import RunDir
from dspark.train.config import ReplayConfig, TrainConfig


def first_divergence(recorded: list[dict], replayed: list[dict], tolerance: float) -> str | None:
    for i, (a, b) in enumerate(zip(recorded, replayed)):
        where = f"record {i} (step {a['step']}, {a['split']})"
        if (a["step"], a["split"]) != (b["step"], b["split"]):
            return f"{where}: replay logged step {b['step']} {b['split']} instead"
        for k in sorted(set(a["metrics"]) | set(b["metrics"])):
            if k not in a["metrics"] or k not in b["metrics"]:
                return f"{where}: metric {k} only in the {'replay' if k not in a['metrics'] else 'record'}"
            x, y = a["metrics"][k], b["metrics"][k]  # None: a value that was not finite (written as null)
            if not (x == y or (None not in (x, y) and math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance))):
                return f"{where}: {k} recorded {x!r}, replayed {y!r}"
    if len(recorded) != len(replayed):
        return f"the record has {len(recorded)} metric records, the replay {len(replayed)}"
    return None


def replay(settings: ReplayConfig, progress: bool = True) -> dict:
    """Retrain RUN into RUN/replays/NNN and compare; it logs to trackers only when `--logger` names some."""
    run, store, tolerance, logger = settings.run, settings.store, settings.tolerance, settings.logger
    rd = RunDir(run)
    rec = rd.record()
    if rec is None:  # refused before anything imports torch
        raise InputError(f"{run} is not a dspark run folder (no config.json)", "pass the --save-path of a run")
    from dspark.connector.base import open_store
    from dspark.connector.registry import store_backend
    from dspark.train.loop import Trainer
    from dspark.train.metrics import MetricLog

    recorded = MetricLog(rd.metrics_path).read()
    if not recorded:
        raise InputError(f"run {run} logged no metrics yet", "replay a run that trained at least --log-freq steps")
    # a run recorded before validations scored the state gain logged no such metrics: its replay scores none
    cfg = TrainConfig.from_dict({"val_state_gain": False, **rec["train"]})
    if store:
        cfg.store = store
    # A live run's cache is a store at rest too: replays read it only, never the live store.
    cfg.source = store_backend(cfg.source).name
    fp = open_store(cfg.store, cfg.source).fingerprint()
    if fp != rec["store_fingerprint"]:
        raise StoreMismatch(f"store {cfg.store} is not the one run {run} trained on (content fingerprint "
                            f"{fp[:12]} != recorded {rec['store_fingerprint'][:12]})",
                            "replay against the original store (pass --store if it moved)")
    out = new_replay_folder(rd.root)
    cfg = replace(cfg, save_path=str(out), max_steps=max(r["step"] for r in recorded),
                  tracking=replace(cfg.tracking, logger=logger))
    skipped = rec.get("skipped") or {}
    trainer = Trainer(cfg, progress=progress)
    trainer.data.reproduce(skipped)
    trainer.fit()
    replayed = MetricLog(out / "metrics.jsonl").read()
    where = first_divergence(recorded, replayed, tolerance)
    note = _skips_note(rec, recorded)
    if where and note:  # a DIVERGED line that says what the replay knew about the difference
        where = f"{where}; {note}"
    return {"run": str(rd.root), "replay": str(out), "records": len(recorded),
            "metrics_compared": sum(len(r["metrics"]) for r in recorded[: len(replayed)]),
            "reproduced": where is None, "first_divergence": where,
            **({"skipped": skipped} if skipped else {}), **({"note": note} if note else {})}


def new_replay_folder(root: Path) -> Path:
    """RUN/replays/NNN, created new: one past the highest number there, so a replay never resumes an earlier
    one (a count of the folders did, once one was deleted); mkdir is exclusive, so two at once get two."""
    folder = root / "replays"
    try:
        folder.mkdir(exist_ok=True)
        taken = [int(p.name) for p in folder.iterdir() if re.fullmatch(r"[0-9]+", p.name)]
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{folder} is not a folder", f"move it aside: replays go into {folder}/NNN") from None
    n = max(taken, default=-1) + 1
    while True:
        try:
            (out := folder / f"{n:03d}").mkdir()
            return out
        except FileExistsError:
            n += 1


def _skips_note(rec: dict, recorded: list[dict]) -> str | None:
    """What the replay did about samples the run could not read, or why it could not."""
    if "skipped" in rec:
        n = sum(map(len, rec["skipped"].values()))
        if not n:
            return None
        passes = "; ".join(f"{where}: {', '.join(map(str, ids[:10]))}{', ...' if len(ids) > 10 else ''}"
                           for where, ids in rec["skipped"].items())
        return (f"the run skipped {n} sample{'s' * (n != 1)} it could not read ({passes}); "
                "the replay left the same ones out")
    live_skips = max((r.get("live", {}).get("skipped", 0) for r in recorded), default=0)
    if live_skips:  # a run from before skips were recorded
        return (f"the run skipped samples its live source could not deliver ({live_skips} skipped reads in its "
                "metrics log) without recording which; the replay read them from the cache, so it differs from "
                "where the first was skipped")
    return None
