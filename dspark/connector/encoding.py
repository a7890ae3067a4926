"""Tensor <-> stored bytes: lossless bf16 bits, or fp8 e4m3 with a scale per token and layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dspark.connector.buffers import READS

if TYPE_CHECKING:  # the functions that move tensors import torch: the manifest's sizes (bytes_per_token) need none
    import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def stored_numpy_dtype(encoding: str, dtype: str) -> np.dtype:
    if encoding == "fp8_e4m3":
        return np.dtype(np.uint8)
    return np.dtype(np.uint32 if dtype == "float32" else np.uint16)


def bytes_per_token(num_layers: int, hidden_size: int, encoding: str, dtype: str) -> int:
    """Stored bytes of one token's states across the captured layers (fp8 scales not counted)."""
    return num_layers * hidden_size * stored_numpy_dtype(encoding, dtype).itemsize


def _pieces(rows: int, width: int, elements: int = 1 << 15):
    """Row slices of <= `elements`: each piece's temporaries stay in cache (3-5x faster than whole passes),
    and torch runs ops that small inline, without its OpenMP team, whose barriers stall for milliseconds
    when reader and writer threads already hold the cores (measured 20x slower)."""
    step = max(1, elements // width)
    return (slice(a, a + step) for a in range(0, rows, step))


def encode(hidden: torch.Tensor, encoding: str) -> tuple[np.ndarray, np.ndarray | None]:
    """`hidden [T, L, H]` -> (payload bits [T, L, H], fp32 scales [T, L] or None)."""
    import torch

    hidden = hidden.detach().cpu().contiguous()
    if encoding == "raw":
        bits = {torch.bfloat16: torch.uint16, torch.float16: torch.uint16, torch.float32: torch.uint32}
        return hidden.view(bits[hidden.dtype]).numpy(), None
    x = hidden.reshape(-1, hidden.shape[-1])
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    for p in _pieces(*x.shape):
        q[p] = x[p].float() / scales[p]
    return q.view(torch.uint8).view(hidden.shape).numpy(), scales.view(hidden.shape[:-1]).numpy()


def decode(payload: np.ndarray, scales: np.ndarray | None, encoding: str, dtype: str) -> torch.Tensor:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(payload))
    if encoding == "raw":
        return t.view(torch_dtype(dtype))
    q = t.reshape(-1, t.shape[-1])
    s = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(-1, 1) * 256
    out = torch.from_numpy(READS.empty(q.shape, stored_numpy_dtype("raw", dtype))).view(torch_dtype(dtype))
    # Pieces 4x encode's: each torch op costs ~5 us of dispatch, part of it holding the GIL, so 32K-element
    # pieces left two reader threads at 1.13x one; 128K ones reach 1.6x for 10% less on one thread.
    for p in _pieces(*q.shape, 1 << 17):
        # e4m3 bits -> the float16 bits of the same value / 2**8: the sign moves from bit 7 to 15 and the
        # rest lands 7 bits up ((i + sign) << 7 does both). Exact for every finite code, subnormals included;
        # float16 math is vectorized where float8's is not (~5x slower).
        i = q[p].to(torch.int16)
        i.add_(i & 0x80).bitwise_left_shift_(7)
        torch.mul(i.view(torch.float16), s[p], out=out[p])  # computed in float32, rounded once
    return out.view(t.shape)

