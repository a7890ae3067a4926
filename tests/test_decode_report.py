"""The decode report per sub-domain: MT-bench categories (and LongBench datasets) get their own acceptance rows."""

import json
import math
from types import SimpleNamespace

import pytest

from dspark.decode import loop
from dspark.data.prompts import Prompt, PromptSet
from dspark.decode.report import markdown
from dspark.decode.config import DecodeConfig
from dspark.decode.run import decode_set
from dspark.core.report import write_report
from dspark.train.checkpoint import RunDir
from dspark.train.metrics import MetricLog

# The first prompt token says how many drafts (of 4) each verifier step accepts for that prompt.
ACCEPTED = {1: [4, 4], 2: [1, 0], 3: [0, 0, 2]}


@pytest.fixture
def scripted(monkeypatch):
    """The decode loop replaced by a script: `decode_set`'s bookkeeping, without a model."""
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
    return decode_set(DecodeConfig(checkpoint="x"), ps, verifier=None, drafter=SimpleNamespace(num_speculative_tokens=4),
                      eos=set(), policies={}, progress=False)


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


def _strict(text: str):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_result_files_are_strict_json_with_an_undefined_value_as_null(tmp_path):
    """decode.json/eval.json, metrics.jsonl and the run record never hold the non-JSON tokens NaN or Infinity."""
    write_report({"speedup": math.nan, "rates": [1.0, math.inf]}, tmp_path, "decode", lambda r: "", lambda *a: None,
                 "t")
    assert _strict((tmp_path / "decode.json").read_text()) == {"speedup": None, "rates": [1.0, None]}

    log = MetricLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "epoch": 0, "split": "train", "metrics": {"loss": math.nan, "tau": 1.5}})
    assert [_strict(line) for line in log.path.read_text().splitlines()] == [
        {"step": 1, "epoch": 0, "split": "train", "metrics": {"loss": None, "tau": 1.5}}]
    log.truncate_after(1)
    assert _strict(log.path.read_text())["metrics"]["loss"] is None

    run = RunDir(tmp_path / "run")
    run.write_record({"train": {"lr": math.inf}})
    assert _strict(run.config_path.read_text()) == {"train": {"lr": None}}
