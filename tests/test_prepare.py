import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import write_jsonl
from dspark.cli import main
from dspark.errors import InputError
from dspark.prepare import PrepareConfig, PreparedData, load_tokenizer, prepare, tokenize_conversation

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


def test_toy_pretraining_text_is_what_the_chat_template_renders(verifier):
    tok = load_tokenizer(verifier)
    by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONV)
    assert tok.apply_chat_template(CONV, tokenize=False) == by_hand
