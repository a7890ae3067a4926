"""What a checkpoint's run recorded: its config, store manifest, prepared data and metrics, found from the
checkpoint folder alone (relative paths resolved as the run saw them)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Provenance:
    """What the checkpoint's run folder, its store and its prepared data recorded; notes for what is unknown."""

    run: Path | None = None
    record: dict | None = None           # RUN/config.json
    train: dict | None = None            # its "train" settings (TrainConfig.to_dict())
    prepared: dict | None = None         # PREPARED/prepare.json
    manifest: dict | None = None         # STORE/manifest.json
    metrics: list[dict] = field(default_factory=list)
    step: int | None = None
    notes: list[str] = field(default_factory=list)
    places: dict[str, str] = field(default_factory=dict)  # local absolute paths -> their placeholders

    def place(self, path, placeholder: str) -> None:
        """Remember a local path (as given when absolute, and resolved) so the card shows `placeholder` instead."""
        if not path:
            return
        path = Path(path).expanduser()
        for form in {str(path.resolve()), *([str(path)] if path.is_absolute() else [])}:
            if form != "/":
                self.places[form] = placeholder


def step_of(ckpt: Path) -> int | None:
    m = re.fullmatch(r"step-(\d+)", ckpt.name)
    return int(m.group(1)) if m else None


def _run_cwd(run: Path, save_path: str) -> Path | None:
    """The folder the training was started from, when the recorded --save-path was relative to it."""
    parts = Path(save_path).parts
    if not parts or Path(save_path).is_absolute() or ".." in parts or "." in parts:
        return None
    here = run.resolve().parts
    return Path(*here[:-len(parts)]) if len(here) > len(parts) and here[-len(parts):] == parts else None


def _find(recorded: str | None, base: Path | None) -> Path | None:
    if not recorded:
        return None
    p = Path(recorded).expanduser()
    candidates = [p] if p.is_absolute() else [c for c in (base / p if base else None, Path.cwd() / p) if c]
    return next((c for c in candidates if c.exists()), None)


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_metrics(path: Path, upto: int | None) -> list[dict]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn or damaged line: the card shows what can be read
        if isinstance(rec, dict) and isinstance(rec.get("metrics"), dict) and \
                (upto is None or not isinstance(rec.get("step"), int) or rec["step"] <= upto):
            out.append(rec)
    return out


def provenance(ckpt: Path) -> Provenance:
    """Read what the run recorded about how `ckpt` (a resolved checkpoint folder) was made."""
    p = Provenance(step=step_of(ckpt))
    run = ckpt.parent.parent
    record = read_json(run / "config.json")
    if not (record and isinstance(record.get("train"), dict) and ckpt.parent.name == "checkpoints"):
        p.notes.append("This checkpoint is not inside a dspark run folder (`<run>/checkpoints/<step>`), so how it "
                       "was trained is not known here.")
        return p
    p.run, p.record, p.train = run, record, record["train"]
    p.metrics = _read_metrics(run / "metrics.jsonl", p.step)
    base = _run_cwd(run, p.train.get("save_path") or "")
    fingerprint = record.get("prepared_fingerprint")
    p.place(run, "<run>")
    for key, placeholder in (("verifier_name_or_path", "<verifier>"), ("data_path", "<prepared>"),
                             ("store", "<store>"), ("save_path", "<run>"), ("draft_config", "<draft_config.json>")):
        p.place(p.train.get(key), placeholder)
        p.place(_find(p.train.get(key), base), placeholder)

    prepared = _find(p.train.get("data_path"), base)
    meta = read_json(prepared / "prepare.json") if prepared else None
    if meta is None:
        p.notes.append("The prepared data folder the run names is not here, so the `dspark prepare` settings "
                       "(sequence length, minimum valid tokens, ...) are not known.")
    elif fingerprint and meta.get("fingerprint") != fingerprint:
        p.notes.append("The prepared data folder the run names now holds other data (its fingerprint differs "
                       "from the run's), so the `dspark prepare` settings are not known.")
    else:
        p.prepared = meta
        p.place((meta.get("config") or {}).get("data"), "<chat.jsonl>")

    store = _find(p.train.get("store"), base)
    manifest = read_json(store / "manifest.json") if store else None
    if manifest is None:
        p.notes.append("The run's hidden-state store is not here, so its manifest (dtype, fp8 or not, chunking) "
                       "is not known.")
    elif (fingerprint and manifest.get("prepared_fingerprint") != fingerprint) or \
            not set(p.train.get("target_layer_ids") or []) <= set(manifest.get("target_layer_ids") or []):
        p.notes.append("The store folder the run names now holds other states (its manifest differs from the "
                       "run's), so the extraction settings are not known beyond the run's.")
    else:
        p.manifest = manifest
    return p
