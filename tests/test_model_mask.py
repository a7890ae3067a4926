"""The drafter's attention mask on CPU: built by broadcasting, the same as flex_attention's create_mask."""

import pytest
import torch


@pytest.mark.parametrize("sliding_window,non_causal", [(None, False), (64, False), (64, True)])
def test_broadcast_mask_is_create_masks(sliding_window, non_causal):
    """The drafter's attention mask, built by broadcasting (dspark.train.model), equals flex_attention's."""
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from torch.nn.attention.flex_attention import create_mask

    from dspark.train.model import broadcast_mask

    g = torch.Generator().manual_seed(0)
    T = 300
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor([90, 70, 100, 40]))
    docs[-25:] = -1  # padding
    anchors = torch.randperm(T - 30, generator=g)[:24].sort().values
    mod, q_len, kv_len = create_anchor_block_mask_mod(docs, T, anchors, 8, sliding_window, non_causal)
    want = create_mask(mod, None, None, q_len, kv_len, device="cpu")
    got = broadcast_mask(mod, None, None, q_len, kv_len, device="cpu")
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
