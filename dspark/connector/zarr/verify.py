"""What verifying a Zarr store finds (`ZarrStore.verify` makes the report) and the notes repairs leave."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from dspark.connector.base import VerifyReport
from dspark.connector.zarr.format import INDEX_RECORD, META_BYTES
from dspark.core.files import FileRefused, read_bounded
from dspark.core.fsio import write_atomic


class ZarrReport(VerifyReport):
    """What verifying a Zarr store found (base.py's report): its damaged index records are (segment, byte offset,
    valid records after it)."""

    def record_line(self, record: tuple) -> str:
        seg, off, after = record
        return (f"segment {seg}: index record {off // INDEX_RECORD.size} (byte {off}) is damaged; the {after} valid "
                "records after it are read")


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
