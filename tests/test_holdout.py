"""`dspark holdout`: no prompt text in both training and held-out data, nor in a reported eval set."""

import gzip
import json

import pytest

from dspark.core.errors import InputError
from dspark.data.holdout import prompt_key, split


def _chat(user, reply="ok"):
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}


CODE = 'def add(a, b):\n    """Return the sum of a and b."""\n'


@pytest.fixture
def data(tmp_path):
    rows = [_chat(f"question number {i}") for i in range(20)]
    rows += [_chat("Question   number 3"), _chat("QUESTION NUMBER 4\n")]  # the same prompts, respaced and recased
    rows += [_chat(f"Please finish this:\n{CODE}")]  # HumanEval's prompt inside a ShareGPT request
    rows += [_chat("hi"), {"conversations": []}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    humaneval.write_bytes(gzip.compress(json.dumps({"task_id": "HumanEval/0", "prompt": CODE}).encode() + b"\n"))
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["hi", "more"]}) + "\n")
    return path, [humaneval, mtbench]


def _prompts(path):
    return [prompt_key(json.loads(line)["messages"][0]["content"]) for line in path.read_text().splitlines()]


def test_split_keeps_every_prompt_on_one_side_and_drops_eval_overlaps(data, tmp_path):
    path, exclude = data
    summary = split(path, tmp_path / "train.jsonl", tmp_path / "held.jsonl", heldout=5, seed=1, exclude=exclude)
    train, held = _prompts(tmp_path / "train.jsonl"), _prompts(tmp_path / "held.jsonl")
    assert len(held) == 5 and summary["heldout"] == 5
    assert not set(train) & set(held)
    assert len(set(train + held)) == len(train) + len(held)  # no duplicate anywhere
    assert summary["dropped_by_reason"]["duplicate_prompt"] == 2
    assert summary["dropped_by_reason"]["empty"] == 1
    # HumanEval's code inside a request (substring) and MT-bench's short "hi" (whole text) never train
    assert not any("def add" in p for p in train) and "hi" not in train
    assert summary["dropped_by_reason"]["overlaps_eval_set"] == 2 - sum(
        p == "hi" or "def add" in p for p in held)
    assert summary["train"] + summary["heldout"] + summary["dropped_by_reason"]["overlaps_eval_set"] == \
        summary["distinct_prompts"] == 22
    assert json.loads((tmp_path / "train.jsonl.summary.json").read_text()) == summary


def test_split_is_seeded(data, tmp_path):
    path, _ = data
    a = split(path, tmp_path / "a.jsonl", tmp_path / "ah.jsonl", heldout=5, seed=7)
    b = split(path, tmp_path / "b.jsonl", tmp_path / "bh.jsonl", heldout=5, seed=7)
    c = split(path, tmp_path / "c.jsonl", tmp_path / "ch.jsonl", heldout=5, seed=8)
    assert (tmp_path / "ah.jsonl").read_bytes() == (tmp_path / "bh.jsonl").read_bytes()
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]


def test_impossible_splits_are_one_line_errors(data, tmp_path):
    path, _ = data
    with pytest.raises(InputError, match="leaves nothing to train on"):
        split(path, tmp_path / "t.jsonl", tmp_path / "h.jsonl", heldout=22, seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(InputError, match="is not JSON lines"):
        split(path, tmp_path / "t.jsonl", tmp_path / "h.jsonl", heldout=1, seed=0, exclude=[bad])
