"""Prompt lookup in the decode loop: vLLM's `method: ngram` proposals, lossless verification of them."""

import json
import subprocess

import numpy as np
import pytest
import torch

from conftest import LAYERS, prompt_ids
from dspark.decode.config import PromptLookupConfig, SamplingConfig
from dspark.decode.loop import autoregressive, speculative
from dspark.decode.ngram import NgramDrafter, lookup
from dspark.decode.report import summarize
from dspark.decode.verifier import Verifier
from services import VLLM_PY

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def decoder_verifier(verifier):
    return Verifier(verifier, LAYERS, "float32")


@pytest.fixture(scope="module")
def prompts(prepared):
    return prompt_ids(prepared, 6)


@pytest.mark.parametrize("tokens,min_n,max_n,k,want", [
    ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),          # suffix "1 2" seen before: what followed it
    ([1, 2, 3, 4, 1, 2], 1, 3, 9, [3, 4, 1, 2]),       # never past the end of what is known
    ([5, 1, 2, 7, 9, 2, 7, 1, 2, 7], 1, 3, 2, [9, 2]),  # the longest suffix wins ("1 2 7", not "2 7" at 5)
    ([2, 7, 8, 2, 7, 9, 2, 7], 1, 3, 1, [8]),          # two equally long matches: the earliest wins
    ([3, 3, 3, 3], 2, 5, 2, [3]),                      # an occurrence may overlap the suffix itself
    ([1, 2, 3, 1, 2], 3, 4, 3, []),                    # only "1 2" matches, shorter than prompt_lookup_min
    ([4, 5, 6], 1, 2, 3, []),                          # nothing repeats
    ([9], 1, 2, 3, []),                                # shorter than any n-gram with an earlier occurrence
])
def test_lookup_proposes_what_followed_the_longest_earliest_match(tokens, min_n, max_n, k, want):
    assert lookup(tokens, min_n, max_n, k) == want


def test_lookup_never_drafts_past_the_models_length():
    assert lookup([1, 2, 3, 1, 2], 1, 2, 4, max_len=7) == [3, 1]
    assert lookup([1, 2, 3, 1, 2], 1, 2, 4, max_len=5) == []


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (bash scripts/setup.sh --vllm)")
@pytest.mark.slow
def test_lookup_equals_vllms_own_ngram_proposer_on_random_requests():
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, int(v), int(n)).tolist(), int(lo), int(lo + extra), int(k))
             for v, n, lo, extra, k in zip(rng.integers(2, 12, 300), rng.integers(1, 60, 300),
                                           rng.integers(1, 4, 300), rng.integers(0, 4, 300), rng.integers(1, 8, 300))]
    code = ("import json, sys, numpy as np\n"
            "from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f\n"
            "print(json.dumps([f(np.array(t, dtype=np.int32), lo, hi, 10**6, k).tolist()\n"
            "                  for t, lo, hi, k in json.load(sys.stdin)]))")
    out = subprocess.run([str(VLLM_PY), "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=300, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(map(bool, theirs)) > 100  # most cases draft something: the comparison has substance
    assert [lookup(*case) for case in cases] == theirs


def test_greedy_ngram_decoding_is_the_verifiers_own_output_and_counts_only_drafted_steps(decoder_verifier, prompts):
    v = decoder_verifier
    eos = {v.model.config.eos_token_id}
    drafter = NgramDrafter(v.model.config.vocab_size, num_speculative_tokens=4,
                           lookup=PromptLookupConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    traces = []
    for prompt in prompts:
        spec = speculative(v, drafter, prompt, 40, sampling=GREEDY, eos=eos)
        assert spec.tokens == autoregressive(v, prompt, 40, sampling=GREEDY, eos=eos).tokens
        traces.append(spec)
    s = summarize(traces, drafter.num_speculative_tokens)
    assert 0 < s["drafted_steps"] < s["drafts"]  # some steps found no match and drafted nothing
    assert s["accepted_tokens"] > 0
    assert s["mean_acceptance_length_drafted"] == pytest.approx(1 + s["accepted_tokens"] / s["drafted_steps"])


def test_ngram_drafts_are_verified_as_one_hot_distributions_at_temperature(decoder_verifier, prompts):
    v = decoder_verifier
    drafter = NgramDrafter(v.model.config.vocab_size, num_speculative_tokens=3,
                           lookup=PromptLookupConfig(prompt_lookup_min=1))
    ctx = drafter.context([5, 6, 7, 5, 6])
    prop = drafter.propose(ctx, 7, SamplingConfig(temperature=1.0))
    assert prop.tokens.tolist() == [5, 6, 7]
    assert prop.probs.shape == (3, v.model.config.vocab_size) and prop.probs.sum().item() == 3
    assert prop.probs[torch.arange(3), prop.tokens].tolist() == [1.0, 1.0, 1.0]
    ctx.rewind(2)
    drafter.extend(ctx, [9, 5])
    assert ctx.tokens == [5, 6, 9, 5] and drafter.propose(ctx, 6, GREEDY).tokens.tolist() == [9, 5, 6]
    gen = torch.Generator().manual_seed(0)
    trace = speculative(v, drafter, prompts[0], 24, sampling=SamplingConfig(temperature=1.0), gen=gen)
    assert len(trace.tokens) == 24 and sum(trace.verified) > 0
