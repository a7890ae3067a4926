"""Tensor <-> stored bytes: lossless bf16 bits, or fp8 e4m3 with a scale per token and layer."""

from __future__ import annotations

import zlib

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_BITS = {torch.bfloat16: torch.uint16, torch.float16: torch.uint16, torch.float32: torch.uint32}


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def stored_numpy_dtype(encoding: str, dtype: str) -> np.dtype:
    if encoding == "fp8_e4m3":
        return np.dtype(np.uint8)
    return np.dtype(np.uint32 if dtype == "float32" else np.uint16)


def bytes_per_token(num_layers: int, hidden_size: int, encoding: str, dtype: str) -> int:
    """Stored bytes of one token's states across the captured layers (fp8 scales not counted)."""
    return num_layers * hidden_size * stored_numpy_dtype(encoding, dtype).itemsize


def encode(hidden: torch.Tensor, encoding: str) -> tuple[np.ndarray, np.ndarray | None]:
    """`hidden [T, L, H]` -> (payload bits [T, L, H], fp32 scales [T, L] or None)."""
    hidden = hidden.detach().cpu().contiguous()
    if encoding == "raw":
        return hidden.view(_BITS[hidden.dtype]).numpy(), None
    x = hidden.float()
    scales = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scales.numpy()


def decode(payload: np.ndarray, scales: np.ndarray | None, encoding: str, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(payload))
    if encoding == "raw":
        return t.view(torch_dtype(dtype))
    x = t.view(torch.float8_e4m3fn).float() * torch.from_numpy(np.ascontiguousarray(scales)).unsqueeze(-1)
    return x.to(torch_dtype(dtype))


def sample_crc(token_ids: np.ndarray, payload: np.ndarray, scales: np.ndarray | None) -> int:
    """CRC32 over exactly the stored bytes of one sample."""
    crc = zlib.crc32(np.ascontiguousarray(token_ids, dtype=np.int64).data)
    crc = zlib.crc32(np.ascontiguousarray(payload).data, crc)
    if scales is not None:
        crc = zlib.crc32(np.ascontiguousarray(scales).data, crc)
    return crc
