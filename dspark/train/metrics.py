"""Metric reduction and the run's metrics log (JSONL: the record replay compares; trackers mirror it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.core.errors import CheckpointError, InputError
from dspark.core.files import FileRefused, read_bounded
from dspark.core.fsio import write_atomic
from dspark.core import jsonio
from dspark.core.jsonio import dump_json
from dspark.core.records import LOG_LIMIT, RUN_FIX, check_metric_record


def accumulate(acc: dict[str, float], metrics: dict) -> None:
    """Add speculators' `*_sum` / `*_total` tensors into running float sums."""
    for k, v in metrics.items():
        acc[k] = acc.get(k, 0.0) + float(v.detach().float().sum()) if torch.is_tensor(v) else acc.get(k, 0.0) + float(v)


def reduce(acc: dict[str, float]) -> dict[str, float]:
    """`x_sum / x_total` for every pair; `accept_len` is tau, the mean acceptance length."""
    out = {}
    for k in sorted(acc):
        if k.endswith("_sum"):
            name = k[: -len("_sum")]
            total = acc.get(f"{name}_total", 0.0)
            if total:
                out[name] = acc[k] / total
    return out


def all_reduce(acc: dict[str, float], device) -> dict[str, float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return acc
    keys = sorted(acc)
    t = torch.tensor([acc[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


class MetricLog:
    """Append-only JSONL: one record per log point, `metrics` compared by replay, `timing` not."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> bool:
        """Drop records a killed run logged past its last checkpoint; resume logs them again.

        A half-written last line (a kill or a full disk mid-append) goes too; says whether there was one.
        """
        records, torn = self._parse(drop_torn_tail=True)
        keep = [r for r in records if r["step"] <= step]
        if torn or len(keep) < len(records) or not self.path.exists():  # else it holds just that: left as it is
            write_atomic(self.path, "".join(dump_json(r) + "\n" for r in keep))
        return torn

    def write(self, record: dict) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(dump_json(record) + "\n")
        except OSError as e:  # a full disk: at worst a torn last line, which a resume drops
            raise CheckpointError(f"could not append to {self.path}: {e.strerror or e}",
                                  "free disk space and rerun the same command: training resumes from its "
                                  "latest checkpoint") from e

    def read(self) -> list[dict]:
        """Every record; a line that is not a whole record is an error naming the file and line."""
        return self._parse(drop_torn_tail=False)[0]

    def _parse(self, drop_torn_tail: bool) -> tuple[list[dict], bool]:
        if not self.path.exists():
            return [], False
        try:
            text = read_bounded(self.path, LOG_LIMIT).decode()
        except (FileRefused, UnicodeDecodeError) as e:
            raise InputError(f"{self.path} {e if isinstance(e, FileRefused) else 'is not UTF-8 text'}",
                             RUN_FIX) from None
        lines = text.splitlines()
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(check_metric_record(jsonio.loads(line), self.path, n))
            except json.JSONDecodeError:  # JSONTooDeep too
                if drop_torn_tail and n == len(lines) and not text.endswith("\n"):
                    return records, True
                raise InputError(f"{self.path} line {n} is not a whole JSON record (damaged or half-written)",
                                 "delete that line or restore the file; a resumed run drops a half-written "
                                 "last line by itself") from None
        return records, False
