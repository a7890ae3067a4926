"""The speculative-decoding loop behind `dspark eval --decode`: exact drafting, lossless verification, honest counts."""

import json
import math
import os

import numpy as np
import pytest
import torch

from conftest import prompt_ids, run_cli, train_cfg, write_jsonl
from dspark.verifier import resolved
from dspark.decode.cost import ConfidenceCut, CostDriven, CostProfile, FixedK, profile
from dspark.decode.drafter import DraftContext, Drafter
from dspark.decode.loop import Trace, accept, autoregressive, prefill, speculative
from dspark.decode.proposal import Proposal
from dspark.decode.report import difference, summarize
from dspark.decode.config import DecodeConfig, SamplingConfig, VerificationConfig
from dspark.decode.verifier import GQA_SDPA, Verifier
from dspark.core.errors import InputError
from dspark.train.model import load_checkpoint
from dspark.data.prepare import PreparedData


GREEDY = SamplingConfig(temperature=0.0)


def refuse_non_json(token):
    raise AssertionError(f"{token} is not JSON")


@pytest.fixture(scope="module")
def decoder(reference_run, verifier):
    c, _ = reference_run
    model = load_checkpoint(os.path.join(c.save_path, "latest"), None, torch.device("cpu")).float()
    return model, Verifier(verifier, model.target_layer_ids, "float32")


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_a_proposed_block_is_the_training_forward_at_that_anchor(sample_from_anchor, store, prepared, verifier, tmp_path):
    from dspark.train.model import build_model

    cfg = train_cfg(store, prepared, verifier, tmp_path / "r", sample_from_anchor=sample_from_anchor)
    torch.manual_seed(0)
    model = build_model(cfg, PreparedData(prepared), torch.device("cpu"), resolved.Verifier.resolve(verifier)).eval()
    drafter = Drafter(model, "dspark")
    assert drafter.num_speculative_tokens == (8 if sample_from_anchor else 7)
    ids, mask = PreparedData(prepared).sample(2)
    ids = torch.as_tensor(ids.astype(np.int64))
    v = Verifier(verifier, cfg.target_layer_ids, "float32")
    v.reset()
    _, states = v.forward(ids)
    T, anchor = len(ids), int(np.argmax(mask > 0)) + 3
    only_this_anchor = torch.zeros(1, T)
    only_this_anchor[0, anchor] = 1
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            states[None], ids[None], only_this_anchor, torch.zeros(1, T, model.config.transformer_layer_config.hidden_size),
            torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None], max_anchors=1)
        ours = model.lm_head(drafter._block_hidden(drafter.context(ids[:anchor], states[:anchor]), int(ids[anchor])))
    torch.testing.assert_close(ours, logits[0], atol=1e-4, rtol=1e-4)  # float32, any x86 CPU


@pytest.mark.parametrize("layout", ["dspark", "dflash-v1"])
def test_the_cached_context_proposes_what_recomputing_it_every_step_proposes(decoder, prepared, layout):
    model, v = decoder
    cached, reference = Drafter(model, layout), Drafter(model, layout, kv_cache=False)
    prompt = prompt_ids(prepared, 1)[0]
    ids = prompt + autoregressive(v, prompt, 48, sampling=GREEDY).tokens
    v.reset()
    _, states = v.forward(ids)
    P = len(prompt)
    ctx, ref = cached.context(ids[:P], states[:P]), reference.context(ids[:P], states[:P])
    # extended as decoding does, by 1 + accepted tokens per step, past the room first reserved
    for step, n in enumerate([1, 9, 3, 1, 5, 9, 9, 2]):
        anchor = ids[ctx.length]
        torch.testing.assert_close(model.lm_head(cached._block_hidden(ctx, anchor)),
                                   model.lm_head(reference._block_hidden(ref, anchor)), rtol=1e-4, atol=1e-4)
        ours, theirs = cached.propose(ctx, anchor, GREEDY), reference.propose(ref, anchor, GREEDY)
        assert ours.tokens.tolist() == theirs.tokens.tolist()
        if layout == "dspark":
            torch.testing.assert_close(ours.confidence, theirs.confidence, rtol=1e-4, atol=1e-5)
        g1, g2 = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
        hot = SamplingConfig(temperature=1.0)
        ours, theirs = cached.propose(ctx, anchor, hot, g1), reference.propose(ref, anchor, hot, g2)
        assert ours.tokens.tolist() == theirs.tokens.tolist()
        torch.testing.assert_close(ours.probs, theirs.probs, rtol=1e-4, atol=1e-6)
        cached.extend(ctx, ids[ctx.length:ctx.length + n], states[ctx.length:ctx.length + n])
        reference.extend(ref, ids[ref.length:ref.length + n], states[ref.length:ref.length + n])
        assert ctx.length == ref.length == len(ref.hidden)
    assert ctx.capacity > P + 9 + cached.slots  # it grew
    ctx.rewind(P)  # a prompt's context, reused: the same proposals as a new one
    fresh = cached.context(ids[:P], states[:P])
    assert cached.propose(ctx, ids[P], GREEDY).tokens.tolist() == cached.propose(fresh, ids[P], GREEDY).tokens.tolist()
    torch.testing.assert_close(cached._block_hidden(ctx, ids[P]), cached._block_hidden(fresh, ids[P]),
                               rtol=0, atol=0)


def test_the_verifiers_grouped_query_attention_computes_what_transformers_sdpa_does(decoder, prepared):
    _, v = decoder
    assert v.model.config._attn_implementation == GQA_SDPA and v.model.config.num_key_value_heads == 2
    prompt = prompt_ids(prepared, 1)[0]
    out = {}
    try:
        for impl in (GQA_SDPA, "sdpa"):
            v.model.set_attn_implementation(impl)
            v.reset()
            last, _ = v.forward(prompt, last_only=True)
            logits, states = v.forward(prompt[:9])  # a verification: 9 tokens under a causal mask
            out[impl] = last, logits, states
    finally:
        v.model.set_attn_implementation(GQA_SDPA)
    for ours, theirs in zip(out[GQA_SDPA], out["sdpa"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    v.reset()
    every, _ = v.forward(prompt)
    torch.testing.assert_close(out[GQA_SDPA][0][0], every[-1], rtol=1e-5, atol=1e-5)  # last_only: that row alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decodes_sharing_one_prompt_forward_match_decodes_with_their_own(decoder, prepared, temperature):
    model, v = decoder
    drafter, eos = Drafter(model, "dspark"), {v.model.config.eos_token_id}
    prompt = prompt_ids(prepared, 3)[2]
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    kw = dict(sampling=SamplingConfig(temperature=temperature), eos=eos)
    alone = [speculative(v, drafter, prompt, 40, gen=gen(), **kw), autoregressive(v, prompt, 40, gen=gen(), **kw),
             speculative(v, drafter, prompt, 40, gen=gen(), verify=ConfidenceCut(0.5), **kw)]
    pre = prefill(v, drafter, prompt)
    shared = [speculative(v, drafter, prompt, 40, gen=gen(), prefilled=pre, **kw),
              autoregressive(v, prompt, 40, gen=gen(), prefilled=pre, **kw),
              speculative(v, drafter, prompt, 40, gen=gen(), verify=ConfidenceCut(0.5), prefilled=pre, **kw)]
    for a, b in zip(alone, shared):
        assert (a.tokens, a.accepted, a.verified) == (b.tokens, b.accepted, b.verified)
        # each is charged the shared forward, as if it had done its own
        assert b.prefill_s == pre.seconds and b.seconds >= b.prefill_s + b.verify_s
    assert shared[0].draft_s >= pre.draft_s
    with pytest.raises(ValueError, match="another prompt"):
        autoregressive(v, prompt[:-1], 4, sampling=GREEDY, prefilled=pre)


@pytest.mark.parametrize("layout,policy", [("dspark", None), ("dspark", "cut"), ("dspark", "cost"),
                                           ("dspark", "fixed"), ("dflash-v1", None)])
def test_greedy_speculative_output_is_the_verifiers_own(decoder, prepared, layout, policy):
    """Whatever a step verifies (every draft, a confidence cut, cost-driven, a fixed k), the output is the verifier's."""
    model, v = decoder
    drafter = Drafter(model, layout)
    traces = []
    eos = {v.model.config.eos_token_id}
    # checks nearly free against drafting: the cost-driven policy verifies while survival is high, cuts the rest
    flat = CostProfile([1], [[10.0 + 0.3 * k for k in range(9)]], {"d": [5.0]})
    verify = {None: None, "cut": ConfidenceCut(0.5), "cost": CostDriven(flat, "d"), "fixed": FixedK(2)}[policy]
    for prompt in prompt_ids(prepared, 6):
        spec = speculative(v, drafter, prompt, 40, sampling=GREEDY, verify=verify, eos=eos)
        if policy == "fixed":
            assert set(spec.verified) == {2}
        if policy == "cost":  # each step is the policy's own choice: replayed on the step's confidences
            assert len(spec.confidence) == len(spec.verified)
            replay = CostDriven(flat, "d")
            for c, n in zip(spec.confidence, spec.verified):
                if replay.plan(0) == 0:
                    assert (c, n) == ([], 0)  # no proposal: the verifier's token alone
                else:
                    assert n == replay(Proposal(torch.zeros(len(c)), None, torch.tensor(c)), 0)
        alone = autoregressive(v, prompt, 40, sampling=GREEDY, eos=eos)
        assert spec.tokens == alone.tokens
        # the verifier alone is summarized per forward after the prompt's, as a step that verified no draft
        s = summarize([alone], drafter.num_speculative_tokens)
        assert s["drafts"] == len(alone.tokens) - 1 and s["mean_acceptance_length"] == 1.0
        assert s["ms_per_verify"] == pytest.approx(1000 * alone.verify_s / (len(alone.tokens) - 1))
        # every step yields its accepted drafts and one token of the verifier's; the last step may pass
        # 40 or a stop token, and is cut there: no step runs after the output is complete
        produced = [a + 1 for a in spec.accepted]
        assert 1 + sum(produced[:-1]) < len(spec.tokens) <= 1 + sum(produced)
        assert all(0 <= a <= n <= drafter.num_speculative_tokens for a, n in zip(spec.accepted, spec.verified))
        traces.append(spec)
    s = summarize(traces, drafter.num_speculative_tokens)
    accepted = [p["accepted"] for p in s["positions"]]
    assert accepted == sorted(accepted, reverse=True) and sum(accepted) == s["accepted_tokens"]
    hist = s["accepted_length_histogram"]
    assert sum(hist) == s["drafts"] and sum(k * n for k, n in enumerate(hist)) == s["accepted_tokens"]
    assert all(p["rate"] <= p["conditional"] for p in s["positions"])  # reaching k is rarer than passing it
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"])
    if policy is None:
        assert s["draft_tokens"] == s["drafts"] * drafter.num_speculative_tokens
    if layout == "dspark" and policy is None:
        assert s["positions"][0]["rate"] > 0.2  # a trained drafter, drafting in its trained layout
    assert sum(t.tokens[-1] in eos for t in traces) >= 3  # most replies end with the stop token, not at 40


class _Oracle:
    """Drafts the verifier's own greedy continuation, so every draft is accepted up to the stop token."""

    confidence = None

    def __init__(self, reference: list[int], prompt_len: int, n: int):
        self.reference, self.prompt_len, self.num_speculative_tokens = reference, prompt_len, n

    def context(self, tokens, states):
        return DraftContext([], [], states)

    def extend(self, ctx, tokens, states):
        ctx.hidden, ctx.length = torch.cat([ctx.hidden, states]), ctx.length + len(states)

    def propose(self, ctx, anchor, *_, **__):
        done = len(ctx.hidden) - self.prompt_len + 1  # output tokens so far: the context stops before the anchor
        n = self.num_speculative_tokens
        return Proposal(torch.tensor((self.reference[done:] + [0] * n)[:n]), None, None)


def test_a_stop_token_among_accepted_drafts_ends_the_request(decoder, prepared):
    model, v = decoder
    eos = {v.model.config.eos_token_id}
    prompt = prompt_ids(prepared, 1)[0]
    reference = autoregressive(v, prompt, 64, sampling=GREEDY, eos=eos).tokens
    assert reference[-1] in eos, "the fixture's verifier should end this reply with its stop token"
    # a block size that puts the stop token inside a block: a step yields n accepted drafts + 1
    n = next(n for n in range(3, 10) if (len(reference) - 1) % (n + 1))
    spec = speculative(v, _Oracle(reference, len(prompt), n), prompt, 64, sampling=GREEDY, eos=eos)
    assert spec.tokens == reference
    assert spec.accepted[:-1] == [n] * (len(spec.accepted) - 1)
    assert len(spec.accepted) == -(-(len(reference) - 1) // (n + 1))  # no step after the output is complete


@pytest.mark.parametrize("method", ["block", "standard"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_the_verifiers_distribution(method, one_hot):
    """Two drafts from q, verified against p: the first two output tokens must be distributed as p0 x p1."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[1.0, 0.2, -1.0], [0.0, 1.2, 0.3], [0.5, 0.5, 0.5]])
    q = torch.softmax(torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, -0.5]]), -1)
    p = torch.softmax(p_logits, -1)
    trials, counts, accepted = 12000, torch.zeros(3, 3), 0
    for _ in range(trials):
        if one_hot:  # vLLM's greedy draft_sample_method at temperature > 0
            drafts = q.argmax(-1)
            probs = torch.nn.functional.one_hot(drafts, 3).float()
        else:
            drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
            probs = q
        a, nxt = accept(p_logits, drafts, probs, 1.0, method, gen)
        out = [*drafts[:a].tolist(), nxt]
        if len(out) == 1:  # the next step sees the same p1 (this p does not depend on the prefix)
            out.append(int(torch.multinomial(p[1], 1, generator=gen)))
        counts[out[0], out[1]] += 1
        accepted += a
    torch.testing.assert_close(counts / trials, p[0][:, None] * p[1][None, :], atol=0.02, rtol=0)
    assert accepted > 0


def test_block_verification_accepts_at_least_as_much_as_standard():
    gen = torch.Generator().manual_seed(1)
    p_logits = torch.randn(5, 6, generator=gen)
    q = torch.softmax(p_logits[:4] + 0.8 * torch.randn(4, 6, generator=gen), -1)
    mean = {}
    for method in ("block", "standard"):
        g = torch.Generator().manual_seed(2)
        mean[method] = np.mean([accept(p_logits, torch.multinomial(q, 1, generator=g)[:, 0], q, 1.0, method, g)[0]
                                for _ in range(4000)])
    assert mean["block"] >= mean["standard"] - 0.03


def test_the_mean_acceptance_length_carries_its_standard_error_over_prompts():
    easy, hard = Trace([0] * 4, verified=[3, 3], accepted=[1, 1]), Trace([0] * 4, verified=[3] * 4, accepted=[0] * 4)
    s = summarize([easy, hard], 3)
    assert s["per_request"] == [[2, 2], [4, 0]] and s["mean_acceptance_length"] == pytest.approx(4 / 3)
    # by hand: rate 1/3; each prompt's share (accepted - rate * steps) / 6 steps = +-2/9; sqrt(2/1 * 2 * (2/9)^2)
    assert s["mean_acceptance_length_se"] == pytest.approx(4 / 9)
    assert summarize([easy], 3)["mean_acceptance_length_se"] is None  # one prompt tells nothing of the spread
    # paired on the same prompts: a drafter against itself differs by exactly nothing, however noisy each is
    assert difference(s, s) == (0.0, 0.0)
    better = summarize([Trace([0] * 4, verified=[3, 3], accepted=[2, 2]), hard], 3)  # one prompt gains 2
    delta, se = difference(better, s)
    # all of the gain on one of two prompts: shares (4/9 - 2/9, -4/9 + 2/9), so as uncertain as one drafter alone
    assert delta == pytest.approx(1 / 3) and se == pytest.approx(4 / 9)
    with pytest.raises(ValueError, match="different prompts"):
        difference(s, summarize([easy], 3))


@pytest.mark.slow
def test_eval_decode_reports_sets_long_context_and_the_teacher_forced_estimate(reference_run, verifier, chat_file,
                                                                                tmp_path):
    c, _ = reference_run
    lb = tmp_path / "lb.jsonl"
    run_cli("longbench", "--output", lb, "--model", verifier, "--lengths", "6000", "400", "--per-length", "1")
    # no user turn: nothing to prompt with (a user turn alone is a prompt: MT-bench-style sets are)
    no_user = write_jsonl(tmp_path / "asks.jsonl", [{"messages": [{"role": "system", "content": "hello"}]}])
    proc = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--decode", "--output", tmp_path / "ev",
                   "--prompts", f"chat={chat_file}", "--prompts", f"long={lb}", "--max-prompts", "2",
                   "--max-new-tokens", "16", "--no-progress")
    assert "%|" not in proc.stderr  # --no-progress draws no bar, the teacher-forced pass's included
    result = json.loads((tmp_path / "ev" / "decode.json").read_text(), parse_constant=refuse_non_json)
    assert [d["name"] for d in result["datasets"]] == ["chat", "long"]
    for d in result["datasets"]:
        assert d["outputs_equal_verifier_only"] == d["prompts"] == 2
        assert len(d["decoded"]["positions"]) == 8 and d["speedup"] > 0
        # fixed N, the best fixed k and cost-driven side by side, each the verifier's own output
        assert list(d["verification"]) == ["fixed N", "best fixed k", "cost-driven"]
        assert d["outputs_equal_verifier_only_per_policy"] == {"best fixed k": 2, "cost-driven": 2}
        assert d["verification"]["fixed N"]["verified_per_step"] == 8
        assert 0 <= d["verification"]["cost-driven"]["verified_per_step"] <= 8
        assert [r["position"] for r in d["confidence_calibration"]] == list(range(1, 9))
    prof, cal = result["cost_profile"], result["calibration"]
    assert len(prof["contexts"]) in (1, 2, 3) and all(len(row) == 9 and min(row) > 0 for row in prof["check_ms"])
    # the best fixed k is chosen on the run's validation split, decoded beside the reported sets, never on them
    assert cal["set"]["name"] == "validation" and 1 <= cal["set"]["prompts"] <= 8 and 0 <= cal["k"]["drafter"] <= 8
    rec = result["recommendation"]
    assert rec["method"] == "dspark" and rec["enable_adaptive_verification"] and rec["fixed_k"] == cal["k"]["drafter"]
    cells = {(r["subdomain"], k): v for r in result["long_context"] for k, v in r["cells"].items()}
    assert cells[("passage_retrieval", "4K-8K")].startswith("beyond the verifier's maximum length")
    assert cells[("continuation", "<=2K")].endswith("(1)")
    assert result["teacher_forced"]["tau_greedy"] > 1
    md = (tmp_path / "ev" / "decode.md").read_text()
    assert "| chat | 2 |" in md and "teacher-forced" in md and md in proc.stdout
    assert (tmp_path / "ev" / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    none = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--decode", "--output", tmp_path / "e2",
                   "--prompts", no_user, "--no-progress", check=False)
    assert none.returncode == 2 and "asks" in none.stderr and "Traceback" not in none.stderr
    twice = run_cli("eval", "--checkpoint", os.path.join(c.save_path, "latest"), "--decode", "--output", tmp_path / "e3",
                    "--prompts", no_user, "--prompts", f"asks={chat_file}", check=False)
    assert twice.returncode == 2 and "named asks" in twice.stderr and "NAME=PATH" in twice.stderr


def test_the_profile_times_every_check_length_and_each_drafters_proposal(decoder, prepared):
    model, v = decoder
    prompt = prompt_ids(prepared, 1)[0]
    p = profile(v, {"d": Drafter(model, "dspark")}, prompt, [12, 30], 9, 2, GREEDY)
    assert p.contexts == [12, 30] and len(p.check_ms) == 2 and all(len(r) == 9 and min(r) > 0 for r in p.check_ms)
    assert len(p.draft_ms["d"]) == 1 and p.draft_ms["d"][0] > 0 and p.repeats == 2
    # the verifier decodes as before after profiling: a prompt's output is still its own
    eos = {v.model.config.eos_token_id}
    assert speculative(v, Drafter(model, "dspark"), prompt, 20, sampling=GREEDY, eos=eos).tokens == \
        autoregressive(v, prompt, 20, sampling=GREEDY, eos=eos).tokens


def test_a_calibration_set_that_is_also_reported_is_refused(chat_file):
    with pytest.raises(InputError, match="also a reported --prompts set"):
        DecodeConfig(checkpoint="ckpt", prompts=[f"chat={chat_file}"],
                     verification=VerificationConfig(calibration_prompts=f"cal={chat_file}")).validate()
    proc = run_cli("eval", "--checkpoint", "none", "--decode", "--prompts", chat_file, "--calibration-prompts",
                   chat_file, check=False)
    assert proc.returncode == 2 and "also a reported --prompts set" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_decode_refuses_a_nan_or_infinite_setting_before_loading_anything(tmp_path):
    """`--temperature inf` once reported every rate 1.000 and a 3.13x speedup, and wrote Infinity into decode.json."""
    proc = run_cli("eval", "--checkpoint", tmp_path / "none", "--decode", "--temperature", "inf", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --temperature inf must be a finite number")
    assert len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(InputError, match=r"^--temperature nan must be a finite number"):
        DecodeConfig(checkpoint="ckpt", temperature=math.nan).validate()
    with pytest.raises(InputError, match=r"^--confidence-threshold nan must be a finite number"):
        DecodeConfig(checkpoint="ckpt", confidence_threshold=math.nan).validate()


@pytest.mark.timeout(60)
def test_longbench_refuses_a_target_length_no_context_window_holds(verifier, tmp_path):
    """`--lengths 1000000000` once ran for minutes; now one line, before any text is built (time-bounded here)."""
    out = tmp_path / "lb.jsonl"
    proc = run_cli("longbench", "--output", out, "--model", verifier, "--lengths", "4096", "1000000000", check=False)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.startswith("error: --lengths 1000000000 is longer than 1048576 tokens"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
