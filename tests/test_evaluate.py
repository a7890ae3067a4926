"""Teacher-forced `dspark eval`: a bounded, seeded sample of anchors estimates what scoring every anchor gives."""

import json
import os

import numpy as np
import pytest
import torch

from conftest import run_cli
from dspark.eval.teacher_forced import allocate_anchors, run_eval


@pytest.fixture(scope="module")
def every_anchor(reference_run, store, tmp_path_factory):
    c, _ = reference_run
    result, _ = run_eval(os.path.join(c.save_path, "latest"), str(store), None, None,
                         str(tmp_path_factory.mktemp("ev") / "all"), "all", "cpu", max_anchors=0)
    return result


def _scores(result: dict) -> dict:
    return {k: result[k] for k in ("blocks", "tau_greedy", "tau_analytic", "positions", "by_context")}


def test_a_cap_at_or_above_every_anchor_scores_each_one_whatever_the_seed(reference_run, store, every_anchor,
                                                                          tmp_path):
    c, _ = reference_run
    a = every_anchor["anchors"]
    assert a["scored"] == a["available"] == every_anchor["blocks"] > 300 and a["max_anchors"] is None
    torch.manual_seed(123)  # the caller's random state plays no part
    capped, _ = run_eval(os.path.join(c.save_path, "latest"), str(store), None, None, str(tmp_path / "cap"), "all",
                         "cpu", max_anchors=a["available"], anchor_seed=7)
    assert _scores(capped) == _scores(every_anchor)
    assert "every anchor" in (tmp_path / "cap" / "eval.md").read_text()


def test_a_cap_scores_a_seeded_subset_of_the_anchors(reference_run, store, every_anchor, tmp_path):
    c, _ = reference_run
    ckpt, n = os.path.join(c.save_path, "latest"), 120
    one, _ = run_eval(ckpt, str(store), None, None, str(tmp_path / "a"), "all", "cpu", max_anchors=n, anchor_seed=1)
    torch.manual_seed(5)
    again, _ = run_eval(ckpt, str(store), None, None, str(tmp_path / "b"), "all", "cpu", max_anchors=n, anchor_seed=1)
    other, _ = run_eval(ckpt, str(store), None, None, str(tmp_path / "c"), "all", "cpu", max_anchors=n, anchor_seed=2)
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
