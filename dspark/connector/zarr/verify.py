"""Verifying a Zarr store (every sample read back against its checksum) and the notes repairs leave."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dspark.connector.zarr.format import META_BYTES
from dspark.connector.zarr.reader import ZarrStore
from dspark.files import FileRefused, read_bounded
from dspark.fsio import write_atomic


@dataclass
class VerifyReport:
    """What `dspark store verify` found; `problems` is empty for a store that holds everything intact."""

    samples: int  # sample ids the store indexes
    damaged: dict[int, str]  # id -> what is wrong, for samples no copy of which reads back intact
    damaged_records: list[tuple[str, int, int]]  # (segment, byte offset, valid records after it) not yet repaired
    repaired_records: int  # damaged index records a `dspark store repair` made good
    missing: list[int] | None  # prepared ids the store lacks; None: not compared (no prepared data given)

    @property
    def problems(self) -> list[str]:
        out = []
        if self.damaged:
            out.append(f"{len(self.damaged)} of {self.samples} samples are damaged (first: {sorted(self.damaged)[:5]})")
        if self.missing:
            out.append(f"{len(self.missing)} prepared samples are missing (first: {self.missing[:5]})")
        if self.damaged_records and self.missing is None:
            out.append(f"{len(self.damaged_records)} damaged index records: the samples they held may be missing")
        return out


REPAIRS = "repairs"  # <store>/repairs/<stamp>.json: damaged index records a repair made good


def note_repair(root: str | Path, records: Iterable[tuple[str, int]], samples: Iterable[int]) -> None:
    """Record that every sample the damaged `records` held is stored again (written after the repair checked)."""
    folder = Path(root) / REPAIRS
    folder.mkdir(exist_ok=True)
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
    write_atomic(folder / name,
                 json.dumps({"damaged_index_records": [list(r[:2]) for r in records], "samples": sorted(samples)}))


def repaired_records(root: str | Path) -> set[tuple[str, int]]:
    """(segment, offset) of the damaged index records a repair noted as made good."""
    root, out = Path(root), set()
    for p in sorted((root / REPAIRS).glob("*.json")) if (root / REPAIRS).exists() else []:
        try:
            out.update((seg, off) for seg, off in json.loads(read_bounded(p, META_BYTES))["damaged_index_records"])
        except (OSError, FileRefused, ValueError, KeyError, TypeError):
            continue  # an unreadable note covers nothing: verify still reports those records
    return out


def verify_store(store: ZarrStore, expected: int | None = None, ids: Iterable[int] | None = None,
                workers: int = 4, progress: bool = False) -> VerifyReport:
    """Read every sample (or `ids`) back against its checksum, list damaged index records, and,
    given the prepared data's sample count, the samples the store lacks."""
    from tqdm import tqdm

    ids = store.sample_ids if ids is None else [i for i in ids if i in store]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        reasons = list(tqdm(pool.map(store.damaged, ids), total=len(ids), desc="verify", unit="sample",
                            disable=not progress))
    noted = repaired_records(store.root)
    records = [r for r in store.damaged_records if r[:2] not in noted]
    missing = None if expected is None else [i for i in range(expected) if i not in store]
    return VerifyReport(len(store), {i: r for i, r in zip(ids, reasons) if r}, records,
                      len(store.damaged_records) - len(records), missing)
