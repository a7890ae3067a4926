"""Device placement, one policy for training, validation, the state-gain scorer and eval: which device, and
which dtype a batch's float tensors take there.
"""

from __future__ import annotations

import torch


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def input_dtype(model: torch.nn.Module, autocast: bool) -> torch.dtype:
    """The dtype of a model's float inputs, decided here alone: bf16 under autocast (half the copy, and autocast's
    ops take it), else the weights' own. A bf16 batch into fp32 weights without autocast fails at the first matmul
    (eval's teacher-forced pass, `train --autocast off` on CUDA)."""
    return torch.bfloat16 if autocast else next(model.parameters()).dtype


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch on `device`, its float tensors in `dtype` (`input_dtype`'s)."""
    return {k: v.to(device, dtype=dtype if v.is_floating_point() else v.dtype, non_blocking=True)
            for k, v in batch.items()}
