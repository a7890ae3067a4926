"""The cost model: how many drafts a step verifies, from measured costs and acceptance (decode/cost.py)."""

import pytest
import torch

from dspark.decode.cost import (CostDriven, CostProfile, FixedK, best_fixed_k, best_k, calibration, expected_rates,
                                profile_contexts)
from dspark.decode.loop import Trace
from dspark.decode.proposal import Proposal
from dspark.decode.report import reach_rates


def test_the_expected_rate_counts_the_bonus_token_and_every_cost():
    # k = 0, 1, 2: 1, 1.5 and 1.7 tokens a step; 2 ms drafting on top of checks of 10, 12, 15 ms
    rates = expected_rates([0.5, 0.2], 2.0, [10.0, 12.0, 15.0])
    assert rates.tolist() == pytest.approx([1 / 12, 1.5 / 14, 1.7 / 17])
    assert best_k([0.5, 0.2], 2.0, [10.0, 12.0, 15.0]) == 1
    # a list of draft costs (one per k): k = 0 drafts nothing and pays nothing (the verifier alone)
    assert expected_rates([0.5, 0.2], [2.0, 4.0], [10.0, 12.0, 15.0]).tolist() == pytest.approx(
        [1 / 10, 1.5 / 14, 1.7 / 19])
    assert best_k([0.1], [5.0], [10.0, 12.0]) == 0  # one draft accepted 10% of the time does not pay 7 ms
    assert best_k([0.9, 0.8, 0.7], 1.0, [10.0, 10.5, 11.0, 11.5]) == 3  # nearly free checks: verify them all
    assert best_k([0.0, 0.0], 1.0, [10.0, 10.0, 10.0]) == 0  # among equal rates, the fewest drafts


def test_the_profile_interpolates_between_contexts_and_holds_beyond_them():
    p = CostProfile([100, 300], [[10.0, 12.0], [20.0, 30.0]], {"d": [4.0], "e": [1.0, 2.0, 3.0]})
    assert p.max_check == 2
    assert p.check(1, 100) == 10.0 and p.check(2, 200) == pytest.approx(21.0) and p.check(2, 5000) == 30.0
    assert p.check(1, 0) == 10.0
    assert (p.draft("d", 0), p.draft("d", 1), p.draft("d", 7)) == (0.0, 4.0, 4.0)  # a block costs the same for any k
    assert (p.draft("e", 2), p.draft("e", 9)) == (2.0, 3.0)  # one after the other: more drafts cost more
    assert CostProfile(**p.to_dict()) == p  # what the result keeps reads back


def test_best_fixed_k_weighs_a_sequential_drafters_growing_cost():
    flat = CostProfile([50], [[10.0, 11.0, 12.0, 13.0]], {"block": [3.0], "seq": [1.0, 4.0, 8.0]})
    reach = [0.6, 0.4, 0.3]
    # block: 1.6/14, 2.0/15, 2.3/16 -> 3; sequential: 1.6/12, 2.0/16, 2.3/21 -> 1
    assert best_fixed_k(reach, flat, "block", 50) == 3
    assert best_fixed_k(reach, flat, "seq", 50) == 1
    assert best_fixed_k([0.05, 0.0, 0.0], flat, "block", 50) == 0
    assert best_fixed_k(reach + [0.2, 0.1], flat, "block", 50) == 3  # no more than the profile measured


def test_cost_driven_verifies_while_the_running_product_of_confidences_pays():
    profile = CostProfile([10], [[10.0, 10.5, 11.0, 11.5, 12.0]], {"d": [2.0]})
    policy = CostDriven(profile, "d")
    prop = lambda conf: Proposal(torch.arange(4), None, torch.tensor(conf))  # noqa: E731
    # survival 0.9, 0.81, 0.081, 0.0081: tokens 1.9/12.5, 2.71/13, 2.791/13.5 ... -> 2
    assert policy(prop([0.9, 0.9, 0.1, 0.1]), 10) == 2
    assert policy(prop([0.01, 0.9, 0.9, 0.9]), 10) == 0  # the first draft is hopeless: the rest cannot pay
    assert policy(prop([0.99, 0.99, 0.99, 0.99]), 10) == 4
    # a proposal that would not have paid (best rate below the verifier's alone: 1/10) holds the next proposals
    # back for 1, 2, 4 ... steps, and one that pays brings them back every step
    policy.reset()
    steps = []
    for conf in ([0.01] * 4, [0.01] * 4, [0.99] * 4):
        while policy.plan(10) == 0:
            steps.append("skip")
        steps.append(policy(prop(conf), 10))
    assert steps == [0, "skip", 0, "skip", "skip", 4] and policy.plan(10) is None
    policy.reset()
    assert policy.plan(10) is None and (policy.backoff, policy.skip) == (0, 0)
    assert FixedK(3)(prop([0.1] * 4), 10) == 3 and FixedK(3).max_drafts == 3 and FixedK(9)(prop([0.1] * 4), 10) == 4


def test_calibration_puts_the_heads_prediction_beside_what_was_accepted():
    t = Trace([0], verified=[2, 2, 2, 1], accepted=[2, 0, 1, 1],
              confidence=[[0.5, 0.5], [0.5, 0.5], [1.0, 0.5], [0.9, 0.9]])
    rows = calibration([t], 2)
    # the last step verified fewer drafts than it had confidences: it tells nothing of position 2
    assert [r["steps"] for r in rows] == [3, 3]
    assert rows[0]["predicted_survival"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert rows[0]["observed_survival"] == pytest.approx(2 / 3)
    assert rows[1]["predicted_survival"] == pytest.approx((0.25 + 0.25 + 0.5) / 3)
    assert rows[1]["observed_survival"] == pytest.approx(1 / 3)
    # conditional: among the 2 steps that accepted position 1, one accepted position 2; their outputs 0.5, 0.5
    assert (rows[1]["reached"], rows[1]["observed_conditional"], rows[1]["predicted_conditional"]) == (2, 0.5, 0.5)
    assert calibration([Trace([0], verified=[3], accepted=[1])], 3) is None  # no head, no calibration
    assert reach_rates([t, Trace([0], verified=[0], accepted=[0])], 2) == pytest.approx([3 / 5, 1 / 5])


def test_the_profiled_contexts_span_the_prompts_halfway_through_their_decode():
    assert profile_contexts([100, 20, 50], 64, None) == [52, 82, 132]
    assert profile_contexts([100, 100], 64, 120) == [120]
    assert profile_contexts([10], 0, None) == [10]
