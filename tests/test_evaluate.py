"""Teacher-forced `dspark eval`: a bounded, seeded sample of anchors estimates what scoring every anchor gives."""

import json
import os

import numpy as np
import pytest
import torch

from conftest import run_cli
from dspark.eval.config import TeacherForcedConfig
from dspark.eval.teacher_forced import allocate_anchors, run_eval


@pytest.fixture(scope="module")
def every_anchor(reference_run, store, tmp_path_factory):
    c, _ = reference_run
    result, _ = run_eval(TeacherForcedConfig(checkpoint=os.path.join(c.save_path, "latest"), store=str(store),
                                             output=str(tmp_path_factory.mktemp("ev") / "all"), split="all",
                                             device="cpu", max_anchors=0))
    return result


def _scores(result: dict) -> dict:
    return {k: result[k] for k in ("blocks", "tau_greedy", "tau_analytic", "positions", "by_context")}


def test_a_cap_at_or_above_every_anchor_scores_each_one_whatever_the_seed(reference_run, store, every_anchor,
                                                                          tmp_path):
    c, _ = reference_run
    a = every_anchor["anchors"]
    assert a["scored"] == a["available"] == every_anchor["blocks"] > 300 and a["max_anchors"] is None
    torch.manual_seed(123)  # the caller's random state plays no part
    capped, _ = run_eval(TeacherForcedConfig(checkpoint=os.path.join(c.save_path, "latest"), store=str(store),
                                             output=str(tmp_path / "cap"), split="all", device="cpu",
                                             max_anchors=a["available"], anchor_seed=7))
    assert _scores(capped) == _scores(every_anchor)
    assert "every anchor" in (tmp_path / "cap" / "eval.md").read_text()


def test_a_cap_scores_a_seeded_subset_of_the_anchors(reference_run, store, every_anchor, tmp_path):
    c, _ = reference_run
    ckpt, n = os.path.join(c.save_path, "latest"), 120
    one, _ = run_eval(TeacherForcedConfig(checkpoint=ckpt, store=str(store), output=str(tmp_path / "a"), split="all",
                                          device="cpu", max_anchors=n, anchor_seed=1))
    torch.manual_seed(5)
    again, _ = run_eval(TeacherForcedConfig(checkpoint=ckpt, store=str(store), output=str(tmp_path / "b"),
                                            split="all", device="cpu", max_anchors=n, anchor_seed=1))
    other, _ = run_eval(TeacherForcedConfig(checkpoint=ckpt, store=str(store), output=str(tmp_path / "c"),
                                            split="all", device="cpu", max_anchors=n, anchor_seed=2))
    assert _scores(one) == _scores(again) and _scores(one) != _scores(other)
    assert one["blocks"] == n and one["anchors"] == {"scored": n, "available": every_anchor["blocks"],
                                                     "max_anchors": n, "seed": 1}
    full = {b["context"].split("-")[0]: b["blocks"] for b in every_anchor["by_context"]}  # by lower edge
    assert all(b["blocks"] <= full[b["context"].split("-")[0]] for b in one["by_context"])
    for p, q in zip(one["positions"], every_anchor["positions"]):
        assert p["tokens"] <= q["tokens"]
    # an estimate of the same statistic: near the full value
    assert one["tau_analytic"] == pytest.approx(every_anchor["tau_analytic"], rel=0.25)
    md = (tmp_path / "a" / "eval.md").read_text()
    assert f"a uniform sample of {n} of {every_anchor['blocks']} anchors, --anchor-seed 1" in md
    assert json.loads((tmp_path / "a" / "eval.json").read_text())["anchors"]["seed"] == 1


def test_anchors_are_allocated_to_batches_as_a_uniform_sample_of_all_of_them():
    available = [50, 0, 200, 750]
    assert allocate_anchors(available, 0, 0) == available
    assert allocate_anchors(available, 1000, 0) == available
    draws = np.array([allocate_anchors(available, 100, seed) for seed in range(400)])
    assert (draws.sum(1) == 100).all() and (draws <= available).all() and (draws[:, 1] == 0).all()
    assert allocate_anchors(available, 100, 3) == draws[3].tolist()
    np.testing.assert_allclose(draws.mean(0), [5, 0, 20, 75], atol=1.0)  # each anchor equally likely


def test_eval_cli_takes_the_anchor_sample(reference_run, store, tmp_path):
    c, _ = reference_run
    proc = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--store", store, "--split", "all",
                   "--max-anchors", "40", "--anchor-seed", "3", "--output", tmp_path / "ev")
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["blocks"] == 40 and result["anchors"]["seed"] == 3
    assert "a uniform sample of 40 of" in proc.stdout


def bf16_batches(monkeypatch):
    """Batches whose float tensors arrive in bf16, as a bf16 store gives them and as CUDA training placed them."""
    from dspark.train.data import TrainData

    collate = TrainData.collate

    def bf16(self, samples):
        batch = collate(self, samples)
        return batch and {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}

    monkeypatch.setattr(TrainData, "collate", bf16)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_eval_takes_bf16_inputs_into_fp32_or_bf16_weights(weights, reference_run, store, tmp_path, monkeypatch):
    """Inputs follow the weights' dtype outside autocast: CUDA's bf16 batches into an fp32 checkpoint crashed the
    teacher-forced pass (`expected m1 and m2 to have the same dtype`), as fp32 batches into bf16 weights do here."""
    import dspark.train.model as tf  # where run_eval takes load_checkpoint from, when it runs

    c, _ = reference_run
    ckpt, n = os.path.join(c.save_path, "latest"), 64
    fp32, _ = run_eval(TeacherForcedConfig(checkpoint=ckpt, store=str(store), output=str(tmp_path / "fp32"),
                                           split="all", device="cpu", max_anchors=n))
    load = tf.load_checkpoint
    monkeypatch.setattr(tf, "load_checkpoint", lambda *a: load(*a).to(weights))
    bf16_batches(monkeypatch)
    ours, _ = run_eval(TeacherForcedConfig(checkpoint=ckpt, store=str(store), output=str(tmp_path / "bf16"),
                                           split="all", device="cpu", max_anchors=n))
    assert ours["blocks"] == fp32["blocks"] == n
    # the same blocks, scored at bf16 precision: a few drafts may flip
    assert ours["tau_analytic"] == pytest.approx(fp32["tau_analytic"], rel=0.05)


def test_eval_compiles_a_handful_of_forward_shapes_not_one_per_batch(reference_run, store, tmp_path, monkeypatch):
    """Each batch scored its own anchor count: a new shape per batch for a compiled forward (CUDA) to guard on.
    Counts are rounded up to powers of two; the forward is compiled here as on CUDA (a plain backend) and its
    graphs counted."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import dspark.train.model as tf  # where run_eval takes load_checkpoint from, when it runs

    c, _ = reference_run
    load, shapes = tf.load_checkpoint, []

    def compiled(*a):
        model = load(*a)
        backbone = torch.compile(model._backbone_forward, backend="eager")

        def forward(*args, max_anchors, **kw):
            shapes.append(max_anchors)
            return backbone(*args, max_anchors=max_anchors, **kw)

        model._backbone_forward = forward
        return model

    monkeypatch.setattr(tf, "load_checkpoint", compiled)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)  # count them all, never fall back to eager
    result, _ = run_eval(TeacherForcedConfig(checkpoint=os.path.join(c.save_path, "latest"), store=str(store),
                                             output=str(tmp_path / "ev"), split="all", device="cpu", max_anchors=300))
    assert result["blocks"] == 300
    batches = len(shapes) // 3  # the real states and two controls, scored alike
    assert batches >= 6 and len(set(shapes)) <= 3
    compiles = counters["stats"]["unique_graphs"]
    assert 0 < compiles <= 4 * len(set(shapes)) < batches * 2, (compiles, shapes)
