"""Metric reduction and the run's metrics log (JSONL, plus TensorBoard when installed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


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

    def __init__(self, path: Path, tensorboard: bool = True):
        self.path = path
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(path.parent / "tensorboard"))
            except ImportError:  # tensorboard is optional
                pass

    def truncate_after(self, step: int) -> None:
        """Drop records a killed run logged past its last checkpoint; resume logs them again."""
        keep = [r for r in self.read() if r["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record["metrics"].items():
                self._tb.add_scalar(f"{record['split']}/{k}", v, record["step"])
            self._tb.flush()

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
