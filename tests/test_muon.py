"""Our Muon: torch's update bit for bit in bf16, close to it in fp32, and fp32 where bf16 is slow."""

import pytest
import torch

from dspark.train.muon import Muon, fast_bf16, ns_dtype_for, zeropower_via_newtonschulz

SHAPES = [(128, 128), (64, 128), (384, 128), (128, 384), (1, 160)]  # the demo drafter's Muon shapes, wide and tall
KW = dict(lr=3e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]


def grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def run(opt_cls, steps, nesterov=True, **kw):
    ps = params()
    opt = opt_cls(ps, nesterov=nesterov, **KW, **kw)
    before, updates = [p.detach().clone() for p in ps], []
    for step in range(steps):
        for p, g in zip(ps, grads(step)):
            p.grad = g
        opt.step()
        updates.append([p.detach() - b for p, b in zip(ps, before)])
        before = [p.detach().clone() for p in ps]
    return ps, opt, updates


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_is_torchs_muon_bit_for_bit(nesterov):
    ours, opt, _ = run(Muon, 4, nesterov, ns_dtype=torch.bfloat16)
    theirs, ref, _ = run(torch.optim.Muon, 4, nesterov)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), ref.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp32_update_stays_within_bf16_rounding_of_torchs():
    """Newton-Schulz in fp32 vs bf16: the updates differ by bf16's rounding, no more.

    bf16 keeps 8 significant bits (0.4% per rounding); over five iterations of three matmuls the
    updates differ by 1-2% (measured: 0.9-1.9% over these shapes and steps), so 3% is the bound.
    """
    _, _, ours = run(Muon, 5, ns_dtype=torch.float32)
    _, _, theirs = run(torch.optim.Muon, 5)
    for step, (u32, u16) in enumerate(zip(ours, theirs)):
        for a, b in zip(u32, u16):
            assert rel(a, b) < 3e-2, (step, a.shape, rel(a, b))


def test_fp32_newton_schulz_is_the_more_exact_one():
    ns = dict(ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)
    for g in grads(0):
        exact = zeropower_via_newtonschulz(g.double(), torch.float64, **ns)
        e32 = rel(zeropower_via_newtonschulz(g, torch.float32, **ns).double(), exact)
        e16 = rel(zeropower_via_newtonschulz(g, torch.bfloat16, **ns).double(), exact)
        assert e32 < 1e-4 < e16, (g.shape, e32, e16)


def test_fp32_leaves_the_momentum_buffer_alone_without_nesterov():
    """Without Nesterov the update is the buffer itself: Newton-Schulz must work on a copy."""
    _, opt, _ = run(Muon, 3, nesterov=False, ns_dtype=torch.float32)
    _, ref, _ = run(torch.optim.Muon, 3, nesterov=False)
    for a, b in zip(opt.state.values(), ref.state.values()):
        assert torch.allclose(a["momentum_buffer"], b["momentum_buffer"], rtol=0, atol=1e-5)


def test_state_dicts_load_both_ways():
    _, ours, _ = run(Muon, 2, ns_dtype=torch.float32)
    _, theirs, _ = run(torch.optim.Muon, 2)
    fresh = Muon(params(), **KW, ns_dtype=torch.float32)
    fresh.load_state_dict(theirs.state_dict())
    assert fresh.ns_dtype == torch.float32 and fresh.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]
    torch.optim.Muon(params(), **KW).load_state_dict(ours.state_dict())


def test_auto_picks_bf16_where_its_matmuls_are_fast_and_fp32_elsewhere(monkeypatch):
    cpu = torch.device("cpu")
    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert fast_bf16(cpu) == fast
    assert ns_dtype_for("auto", cpu) == (torch.bfloat16 if fast else torch.float32)
    assert ns_dtype_for("bf16", cpu) == torch.bfloat16 and ns_dtype_for("fp32", cpu) == torch.float32
    # A CPU with neither (AVX2, or AVX-512 alone), where bf16 Newton-Schulz is 1.5-25x slower than fp32:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert ns_dtype_for("auto", cpu) == torch.float32
    if torch.cuda.is_available():
        assert ns_dtype_for("auto", torch.device("cuda")) == (torch.bfloat16 if torch.cuda.is_bf16_supported()
                                                               else torch.float32)
