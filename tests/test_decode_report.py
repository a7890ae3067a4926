"""The decode report per sub-domain: MT-bench categories (and LongBench datasets) get their own acceptance rows."""

from types import SimpleNamespace

import pytest

from dspark.decode import loop
from dspark.decode.prompts import Prompt, PromptSet
from dspark.decode.report import markdown
from dspark.decode.run import DecodeConfig, _decode_set

# The first prompt token says how many drafts (of 4) each verifier step accepts for that prompt.
ACCEPTED = {1: [4, 4], 2: [1, 0], 3: [0, 0, 2]}


@pytest.fixture
def scripted(monkeypatch):
    """The decode loop replaced by a script: `_decode_set`'s bookkeeping, without a model."""
    def speculative(verifier, drafter, ids, max_new, **kw):
        acc = ACCEPTED[ids[0]]
        return loop.Trace(tokens=[7] * (sum(acc) + len(acc)), verified=[4] * len(acc), accepted=list(acc),
                          draft_s=0.01, verify_s=0.02, seconds=0.05)

    def autoregressive(verifier, ids, max_new, **kw):
        return loop.Trace(tokens=[7] * (sum(ACCEPTED[ids[0]]) + len(ACCEPTED[ids[0]])), verify_s=0.05, seconds=0.1)

    monkeypatch.setattr(loop, "prefill", lambda *a, **kw: None)
    monkeypatch.setattr(loop, "speculative", speculative)
    monkeypatch.setattr(loop, "autoregressive", autoregressive)


def _decode(prompts: list[Prompt], name: str, fmt: str) -> dict:
    ps = PromptSet(name, f"{name}.jsonl", prompts, {}, format=fmt)
    return _decode_set(DecodeConfig(checkpoint="x", confidence_threshold=None), ps, verifier=None,
                       drafter=SimpleNamespace(num_speculative_tokens=4), eos=set(), use_confidence=False,
                       progress=False)


def test_the_decode_report_gives_per_position_acceptance_per_mtbench_category(scripted):
    mt = _decode([Prompt((1, 5), "writing"), Prompt((2, 5), "math"), Prompt((3, 5), "math")], "mt", "mtbench")
    assert list(mt["by_subdomain"]) == ["writing", "math"]  # in the order the file has them
    writing, math = mt["by_subdomain"]["writing"], mt["by_subdomain"]["math"]
    assert (writing["requests"], writing["drafts"], math["requests"], math["drafts"]) == (1, 2, 2, 5)
    assert [p["rate"] for p in writing["positions"]] == [1.0, 1.0, 1.0, 1.0]
    assert [p["rate"] for p in math["positions"]] == [0.4, 0.2, 0.0, 0.0]  # steps accepting 1, 0, 0, 0, 2 of 4
    assert writing["mean_acceptance_length"] == 5.0 and math["mean_acceptance_length"] == pytest.approx(1.6)
    assert mt["decoded"]["drafts"] == 7 and mt["decoded"]["accepted_tokens"] == 11  # overall: both categories
    plain = _decode([Prompt((1, 5)), Prompt((2, 5))], "chat", "chat")
    assert plain["by_subdomain"] == {}  # no sub-domains, no per-sub-domain rows

    result = {"num_speculative_tokens": 4, "layout": "dspark", "sampling": "greedy", "max_new_tokens": 16,
              "datasets": [plain, mt]}
    md = markdown(result)
    assert "| dataset | sub-domain | prompts | drafts | 1 | 2 | 3 | 4 | mean length |" in md
    assert "| mt | writing | 1 | 2 | 1.000 | 1.000 | 1.000 | 1.000 | 5.00 |" in md
    assert "| mt | math | 2 | 5 | 0.400 | 0.200 | 0.000 | 0.000 | 1.60 |" in md
    assert "| chat | - |" not in md and "| mt | 3 | 7 |" in md  # the overall row is still there
    assert "sub-domain" not in markdown({**result, "datasets": [plain]})
