"""torch.optim.Muon with Newton-Schulz in a chosen dtype.

torch's Muon always orthogonalizes in bf16: fast on GPUs and on CPUs with bf16 dot products
(AVX512-BF16 or AMX), but a CPU without them runs bf16 matmuls through conversions. Measured on
the demo drafter's Muon shapes (9 matrices up to 384x128, 2 threads, one AVX512-BF16 CPU limited
with ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY): Newton-Schulz for one step takes 3.7 ms in bf16 vs
5.0 ms in fp32 with AVX512-BF16, 7.7 vs 5.0 ms with AVX-512 alone, and 125 vs 5.2 ms with AVX2.
So there it runs in fp32 (more exact, not less). Given bf16, this optimizer's update is torch's,
bit for bit (tests/test_muon.py), and its state_dict is torch's: checkpoints of either load in the other.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr
from torch.optim.optimizer import _to_scalar


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are fast here: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported",
                                                                     "_is_amx_tile_supported"))
    return False


def ns_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """`--muon-ns-dtype`: bf16, fp32, or auto (bf16 where its matmuls are fast, else fp32)."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def zeropower_via_newtonschulz(grad: torch.Tensor, dtype: torch.dtype, ns_coefficients: tuple[float, float, float],
                               ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz, computed in `dtype` rather than always bf16."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    ortho = grad.to(dtype, copy=True)  # a copy: the in-place scaling below must not touch the caller's tensor
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, param groups and state) with `ns_dtype` for Newton-Schulz.

    The dtype is an attribute, not a param-group setting, so state_dicts stay torch's.
    """

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = _to_scalar(group["lr"]), group["weight_decay"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):  # torch's _single_tensor_muon, NS dtype aside
                if grad.ndim != 2:
                    raise ValueError("Param gradient must be a 2D matrix")
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = zeropower_via_newtonschulz(update, self.ns_dtype, group["ns_coefficients"],
                                                    group["ns_steps"], group["eps"])
                param.mul_(1 - lr * wd)
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
