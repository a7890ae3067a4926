"""Every input read is bounded: gzip bombs, huge lines, whitespace gaps, deep JSON, huge conversations, GGUF
counts and N x M matching are one `error:` line (or a counted drop) in bounded memory and time (issue 41)."""

import codecs
import gzip
import json
import random
import resource
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest

from conftest import run_cli
from dspark.core import files
from dspark.core.errors import InputError
from dspark.data.prepare import MAX_CONVERSATION_CHARS, read_conversations

AS_LIMIT = 1 << 30  # a CLI run reading a bomb gets 1 GiB of address space: the old readers died in MemoryError


def _chat(user: str, reply: str = "ok") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _write_chat(path, n=6):
    path.write_text("".join(json.dumps(_chat(f"question number {i}")) + "\n" for i in range(n)))
    return path


def _gzip_repeated(path, piece: bytes, times: int, head: bytes = b""):
    """A gzip file inflating to head + piece * times, built from one compressed member repeated (fast, small)."""
    member = gzip.compress(piece, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(times):
            f.write(member)
    return path


def _cli_limited(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dspark.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS,
                                                                                   (AS_LIMIT, AS_LIMIT)))


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def _holdout(tmp_path, data, *extra):
    return _cli_limited("holdout", "--data", data, "--train", tmp_path / "t.jsonl", "--heldout-output",
                        tmp_path / "h.jsonl", "--heldout", 1, *extra)


@pytest.mark.parametrize("flag", ["--data", "--exclude"])
def test_a_gzip_bomb_of_one_huge_line_is_one_line_in_bounded_memory(tmp_path, flag):
    # 1 MiB on disk, one 1 GiB line: the old readers held it whole (MemoryError under the limit)
    bomb = _gzip_repeated(tmp_path / "bomb.jsonl.gz", b"a" * (16 << 20), 64)
    data = bomb if flag == "--data" else _write_chat(tmp_path / "chat.jsonl")
    proc = _holdout(tmp_path, data, *(("--exclude", bomb) if flag == "--exclude" else ()))
    line = _one_error_line(proc)
    assert str(bomb) in line and f"over {files.MAX_LINE_BYTES} bytes" in line and "MAX_LINE_BYTES" in line
    assert not (tmp_path / "t.jsonl").exists()


def test_a_gzip_stream_inflating_past_its_ratio_is_refused_before_it_is_all_inflated(tmp_path):
    # "[" then 1 GiB of spaces from 1 MiB: the old array reader kept every space (MemoryError under the limit)
    bomb = _gzip_repeated(tmp_path / "bomb.json.gz", b" " * (16 << 20), 64, head=b"[")
    start = time.monotonic()
    line = _one_error_line(_holdout(tmp_path, bomb))
    assert str(bomb) in line and f"{files.GZIP_MAX_RATIO} times its compressed size" in line and "gunzip -k" in line
    assert time.monotonic() - start < 60


def test_a_long_line_or_array_record_of_a_plain_file_is_refused_naming_its_line(tmp_path, monkeypatch):
    import dspark.data.prepare as prepare

    monkeypatch.setattr(files, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(prepare, "_ARRAY_CHUNK", 256)  # a record spanning chunks: held until it ends
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(json.dumps(_chat("short")) + "\n" + json.dumps(_chat("x" * 2000)) + "\n")
    with pytest.raises(InputError, match=r"chat\.jsonl line 2 is over 1000 bytes \(dspark.core.files.MAX_LINE_BYTES\)"):
        read_conversations(jsonl)
    array = tmp_path / "chat.json"
    array.write_text(json.dumps([_chat("short"), _chat("x" * 2000)], indent=1))
    with pytest.raises(InputError, match=r"chat\.json:\d+: record 2 is over 1000 bytes"):
        read_conversations(array)


def test_whitespace_between_json_array_records_is_skipped_as_it_streams(tmp_path, monkeypatch):
    import dspark.data.prepare as prepare

    monkeypatch.setattr(prepare, "_ARRAY_CHUNK", 4096)
    gap = " \n" * (2 << 20)  # 4 MiB of space between two records: the old reader held all of it
    path = tmp_path / "gap.json"
    path.write_text("[" + json.dumps(_chat("first")) + "," + gap + json.dumps(_chat("second")) + "]")
    tracemalloc.start()
    try:
        data = read_conversations(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [c[0]["content"] for c in data.conversations] == ["first", "second"]
    assert peak < 1 << 20, peak
    # a cut after a gap still counts every byte after the last complete record, as before
    cut = tmp_path / "cut.json"
    cut.write_text("[" + json.dumps(_chat("first")) + "," + gap)
    data = read_conversations(cut)
    assert data.cut_bytes == 1 + len(gap) and len(data.conversations) == 1


DEEP = "[" * 100_000 + "]" * 100_000
DEEP_RECORD = '{"messages": ' + DEEP + "}"  # a JSONL line (not an array): the format is detected from it


@pytest.mark.parametrize("case", ["jsonl", "array", "exclude"])
def test_json_nested_100k_deep_is_one_line_naming_the_file(tmp_path, case):
    chat = _write_chat(tmp_path / "chat.jsonl")
    deep = tmp_path / "deep.jsonl"
    if case == "array":
        deep.write_text("[" + json.dumps(_chat("fine")) + ",\n" + DEEP + "]")
    else:
        deep.write_text(json.dumps(_chat("fine")) + "\n" + DEEP + "\n")
    proc = _holdout(tmp_path, *((chat, "--exclude", deep) if case == "exclude" else (deep,)))
    line = _one_error_line(proc)
    assert f"{deep}:2" in line and "nested deeper than 500 levels" in line


def test_deep_json_in_prepare_and_in_every_prompt_format_is_one_line(tmp_path, verifier):
    from dspark.data.prompts import load_prompt_set
    from dspark.data.prepare import load_tokenizer

    deep = tmp_path / "deep.jsonl"
    deep.write_text(DEEP_RECORD + "\n")
    line = _one_error_line(run_cli("prepare", "--model", verifier, "--data", deep, "--output", tmp_path / "out",
                                   check=False))
    assert f"{deep}:1" in line and "nested deeper" in line
    tok = load_tokenizer(verifier)
    with pytest.raises(InputError, match=r"deep\.jsonl:1: malformed JSON \(nested deeper"):
        load_prompt_set(str(deep), tok)  # compare/eval --prompts: a first record too deep to detect the format
    humaneval = tmp_path / "humaneval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "t/0", "prompt": "def f():\n"}) + "\n" + DEEP_RECORD + "\n")
    with pytest.raises(InputError, match=r"humaneval\.jsonl:2: not a JSON line \(JSONTooDeep\)"):
        load_prompt_set(str(humaneval), tok)


@pytest.mark.parametrize("bom", [codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE])
def test_a_utf32_file_is_called_utf32_with_the_iconv_line_that_converts_it(tmp_path, bom):
    path = tmp_path / "chat.jsonl"
    encoding = "utf-32-le" if bom == codecs.BOM_UTF32_LE else "utf-32-be"
    path.write_bytes(bom + (json.dumps(_chat("hi")) + "\n").encode(encoding))
    with pytest.raises(InputError, match="is UTF-32 text, not UTF-8") as e:
        read_conversations(path)
    assert f"iconv -f UTF-32 -t UTF-8 {path}" in str(e.value)


def _naive_overlap(texts, users, min_chars):
    """holdout's --exclude rule as it was written before its index: the reference semantics."""
    short = {t for t in texts if len(t) < min_chars}
    joined = "\0".join(users)
    return any(u in short for u in users) or any(t in joined for t in texts if len(t) >= min_chars)


def test_exclude_matching_keeps_its_rule_exactly():
    from dspark.data.holdout import MIN_OVERLAP_CHARS, ExcludeIndex

    rng = random.Random(0)
    alphabet = "ab \0"  # few letters: many partial matches, texts at every length around MIN_OVERLAP_CHARS
    for _ in range(3000):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 70))) for _ in range(rng.randint(1, 5))]
        users = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 150))) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:  # plant an eval text somewhere, maybe across a turn boundary
            k, t = rng.randrange(len(users)), rng.choice(texts)
            cut = rng.randint(0, len(users[k]))
            users[k] = users[k][:cut] + t + users[k][cut:]
        assert ExcludeIndex(texts).overlaps(users) == _naive_overlap(texts, users, MIN_OVERLAP_CHARS), (texts, users)


def test_exclude_of_8k_prompts_against_8k_conversations_takes_seconds(tmp_path):
    from dspark.data.holdout import split

    rng = random.Random(1)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]

    def sentence(n):
        return " ".join(rng.choice(vocab) for _ in range(n))

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(_chat(f"conversation {i}: {sentence(150)}")) + "\n" for i in range(8000)))
    exclude = tmp_path / "eval.jsonl"
    planted = sentence(12)  # one eval prompt inside one conversation: found, and only it
    rows = [{"prompt": f"eval {i}: {sentence(40)}"} for i in range(7999)] + [{"prompt": planted}]
    exclude.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = data.read_text().splitlines()
    lines[123] = json.dumps(_chat(f"please answer: {planted} thanks"))
    data.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    summary = split(data, tmp_path / "t.jsonl", tmp_path / "h.jsonl", heldout=0, seed=0, exclude=[exclude])
    assert time.monotonic() - start < 30  # N x M took 210 s
    assert summary["dropped_by_reason"] == {"overlaps_eval_set": 1} and summary["train"] == 7999


def test_a_conversation_too_long_to_tokenize_is_dropped_by_reason_before_templating(tmp_path, verifier):
    data = _write_chat(tmp_path / "chat.jsonl", 3)
    with open(data, "a") as f:
        f.write(json.dumps(_chat("word " * (MAX_CONVERSATION_CHARS // 5 + 1))) + "\n")
    start = time.monotonic()
    proc = run_cli("prepare", "--model", verifier, "--data", data, "--output", tmp_path / "out", "--seq-length", 64,
                   check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])  # after the "prepare OUT: written" line
    assert summary["dropped_by_reason"] == {"over_max_chars": 1} and summary["kept"] == 3
    assert time.monotonic() - start < 60
    line = _one_error_line(run_cli("prepare", "--model", verifier, "--data", data, "--output", tmp_path / "o2",
                                   "--strict", check=False))
    assert f"{data}:4" in line and "MAX_CONVERSATION_CHARS" in line and "[over_max_chars]" in line


def test_a_prompt_too_long_to_tokenize_is_dropped_by_reason(tmp_path, verifier):
    from dspark.data.prompts import load_prompt_set
    from dspark.data.prepare import load_tokenizer

    path = tmp_path / "humaneval.jsonl"
    rows = [{"task_id": "t/0", "prompt": "def f():\n"},
            {"task_id": "t/1", "prompt": "x" * (MAX_CONVERSATION_CHARS + 1)}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pset = load_prompt_set(str(path), load_tokenizer(verifier))
    assert len(pset.prompts) == 1 and pset.dropped == {"over_max_chars": 1}


def _gguf_with(tmp_path, key: str, patch):
    from test_verifier_import import write_gguf

    path = write_gguf(tmp_path / "src" / "tiny.gguf")
    raw = bytearray(path.read_bytes())
    at = raw.index(key.encode()) + len(key)
    patch(raw, at)
    path.write_bytes(raw)
    return path


@pytest.mark.timeout(90)
def test_a_gguf_array_claiming_2_to_the_40_entries_is_one_line_at_once(tmp_path):
    def count(raw, at):  # after the key: value type ARRAY, item type, count
        assert struct.unpack_from("<I", raw, at)[0] == 9
        struct.pack_into("<Q", raw, at + 8, 1 << 40)

    path = _gguf_with(tmp_path, "tokenizer.ggml.token_type", count)
    start = time.monotonic()
    proc = run_cli("verifier", "import", path, "--output", tmp_path / "out", check=False)
    line = _one_error_line(proc)
    assert str(path) in line and "tokenizer.ggml.token_type claims 1099511627776 entries" in line
    assert time.monotonic() - start < 60 and not (tmp_path / "out").exists()


def test_a_gguf_string_longer_than_the_file_is_refused(tmp_path):
    from dspark.verifier.importer import check_gguf_metadata

    def length(raw, at):  # general.name: value type STRING, then its length
        assert struct.unpack_from("<I", raw, at)[0] == 8
        struct.pack_into("<Q", raw, at + 4, 1 << 50)

    path = _gguf_with(tmp_path, "general.name", length)
    with pytest.raises(InputError, match=r"general\.name claims 1125899906842624 entries of at least 1 bytes, more "
                                         r"than the \d+ bytes left"):
        check_gguf_metadata(path)


@pytest.mark.parametrize("command", ["prepare", "regenerate"])
def test_a_layer_types_list_of_another_length_than_the_layers_is_one_line(tmp_path, verifier, command):
    model = tmp_path / "model"
    shutil.copytree(verifier, model)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = config.get("layer_types", ["full_attention"] * config["num_hidden_layers"])[:-1]
    (model / "config.json").write_text(json.dumps(config))
    data = _write_chat(tmp_path / "chat.jsonl", 2)
    line = _one_error_line(run_cli(command, "--model", model, "--data", data, "--output", tmp_path / "out",
                                   check=False))
    assert f"{model / 'config.json'}" in line and "layer_types holds" in line and "num_hidden_layers" in line
