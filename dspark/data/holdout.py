"""`dspark holdout`: split a chat file into training and held-out prompts, with no prompt in both.

Held-out means held out: a drafter scored on prompts it was trained on reports a number
no user will see. Real dumps repeat themselves (ShareGPT holds the same question many
times), so a random split alone leaks. Here:

- a conversation's *prompt* is its first user turn, compared as text with whitespace runs
  collapsed and case folded (`prompt_key`); conversations whose prompt was seen before are
  dropped as `duplicate_prompt` (the first one is kept);
- `heldout` conversations are drawn by a seeded shuffle; the rest is the training file;
- `--exclude FILE` (repeatable: HumanEval, MT-bench, any prompt file reported on) removes
  from training every conversation whose user turns contain one of that file's user-side
  texts (HumanEval's `prompt`, MT-bench's `turns`, chat users' contents), counted as
  `overlaps_eval_set`. Texts shorter than `MIN_OVERLAP_CHARS` are compared whole instead of
  as substrings: "hi" inside a conversation says nothing.

Both outputs are OpenAI `messages` JSONL, as `dspark prepare` and `dspark regenerate` read them;
a summary (counts by reason) is printed and written to `TRAIN.summary.json`.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dspark.core.errors import InputError
from dspark.verifier.fingerprint import sha256_json
from dspark.core.files import file_xxh3
from dspark.core.fsio import replacing, write_atomic
from dspark.core.jsonio import dump_json
from dspark.core.outputs import check_output, distinct, output_lock, writing
from dspark.core.records import object_or_none
from dspark.core.settings import setting


@dataclass
class HoldoutConfig:
    """`dspark holdout`: which conversations are held out, and which reported prompts leave training."""

    data: str = setting(help="Chat data in any format prepare reads.")
    train: str = setting(help="Training JSONL to write.")
    heldout_output: str = setting(help="Held-out JSONL to write.")
    heldout: int = setting(help="Conversations to hold out.", ge=0)
    exclude: list[str] = setting(factory=list, help="A prompt file reported on (HumanEval, MT-bench, chat JSONL; "
                                                    "repeatable): its prompts leave training.")
    seed: int = setting(0)
    force: bool = setting(False, "Overwrite existing --train/--heldout-output files that an earlier holdout did not "
                                 "write (never --data or an --exclude file).", negatable=False)

MIN_OVERLAP_CHARS = 40
SUMMARY_BYTES = 1 << 20  # a summary is a few KB: a larger file is not one holdout wrote
_SPACE = re.compile(r"\s+")
_USER_KEYS = {"prompt", "turns", "question", "instruction", "input"}  # prompt-file fields that hold user text


def prompt_key(text: str) -> str:
    return _SPACE.sub(" ", text).strip().casefold()


def _user_texts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user" and isinstance(m.get("content"), str)]


def _record_texts(record) -> list[str]:
    """Every user-side string of one prompt-file record, whatever its format."""
    if not isinstance(record, dict):
        return []
    out = []
    for key, value in record.items():
        if key in ("messages", "conversations") and isinstance(value, list):
            out += [str(t.get("content", t.get("value", ""))) for t in value if isinstance(t, dict)
                    and str(t.get("role", t.get("from", ""))).lower() in ("user", "human", "prompter")]
        elif key in _USER_KEYS and isinstance(value, str):
            out.append(value)
        elif key in _USER_KEYS and isinstance(value, list):
            out += [v for v in value if isinstance(v, str)]
    return out


def eval_texts(path: Path) -> list[str]:
    """The user-side texts of a prompt file (JSONL or a JSON array, gzip or not), read as `prepare` reads data."""
    from dspark.data.prepare import ChatData, read_records

    if not path.is_file():
        raise InputError(f"--exclude file {path} does not exist", "pass the prompt files you will report on")
    fix = "pass a prompt file in a format `dspark eval --decode --prompts` reads"

    def invalid(where: str, detail: str, _fix: str) -> None:
        raise InputError(f"--exclude file {path} is not JSON lines or a JSON array ({where}: {detail})", fix)

    data = ChatData([], [])
    texts = [prompt_key(t) for _, r in read_records(path, data, invalid) for t in _record_texts(r) if t.strip()]
    if data.cut_warning:  # an eval set read in part would leak the rest into training
        raise InputError(f"--exclude file {data.cut_warning}", "download it again")
    if not texts:
        raise InputError(f"--exclude file {path} holds no user text",
                         "pass chat JSONL, HumanEval, MT-bench or LongBench prompt files")
    return texts


class ExcludeIndex:
    """`--exclude`'s rule, in time linear in a conversation's length whatever the number of eval texts.

    A conversation overlaps the eval set when one of its user texts equals a short eval text, or a
    long one (>= `MIN_OVERLAP_CHARS`) occurs in its user texts (joined by NUL, so never across two
    turns). Long texts are found through `_GRAM`-character pieces: a text occurring at position i
    covers the sampled position p, the first multiple of `_STRIDE` from i (p - i < `_STRIDE`, and
    the piece at p ends inside the text, since `_STRIDE - 1 + _GRAM <= MIN_OVERLAP_CHARS`), so
    indexing each text by its pieces at offsets 0.._STRIDE-1 finds every occurrence, which is then
    checked in full.
    """

    _GRAM = _STRIDE = MIN_OVERLAP_CHARS // 2

    def __init__(self, texts: list[str]):
        self.short = {t for t in texts if len(t) < MIN_OVERLAP_CHARS}
        self.pieces: dict[str, list[tuple[str, int]]] = {}
        for t in {t for t in texts if len(t) >= MIN_OVERLAP_CHARS}:
            for o in range(self._STRIDE):
                self.pieces.setdefault(t[o:o + self._GRAM], []).append((t, o))

    def overlaps(self, users: list[str]) -> bool:
        """Whether user texts `users` (each a `prompt_key`) hold an eval text."""
        if any(u in self.short for u in users):
            return True
        joined = "\0".join(users)
        for p in range(0, len(joined) - self._GRAM + 1, self._STRIDE):
            for t, o in self.pieces.get(joined[p:p + self._GRAM], ()):
                if p >= o and joined.startswith(t, p - o):
                    return True
        return False


def split(data: Path, train_out: Path, heldout_out: Path, heldout: int, seed: int,
          exclude: list[Path] = (), force: bool = False) -> dict:
    from dspark.data.prepare import read_conversations

    if heldout < 0:
        raise InputError(f"--heldout {heldout} is negative", "pass how many conversations to hold out")
    _check_paths(Path(data), Path(train_out), Path(heldout_out), [Path(p) for p in exclude], force)
    chats = read_conversations(Path(data))
    dropped = Counter(chats.dropped)
    unique, seen = [], set()
    for messages in chats.conversations:
        users = _user_texts(messages)
        key = prompt_key(users[0]) if users else ""
        if not key:
            dropped["no_user_text"] += 1
        elif key in seen:
            dropped["duplicate_prompt"] += 1
        else:
            seen.add(key)
            unique.append((key, messages))
    if heldout >= len(unique):
        raise InputError(f"--heldout {heldout} leaves nothing to train on ({len(unique)} distinct prompts in {data})",
                         f"hold out fewer than {len(unique)}")
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    held = sorted(order[:heldout])  # file order within each side: reruns and diffs stay readable
    held_set = set(held)
    excluded = ExcludeIndex([t for path in exclude for t in eval_texts(Path(path))])
    train = []
    for i, (key, messages) in enumerate(unique):
        if i in held_set:
            continue
        if excluded.overlaps([prompt_key(t) for t in _user_texts(messages)]):
            dropped["overlaps_eval_set"] += 1
            continue
        train.append(messages)
    with output_lock("--train", Path(train_out)):
        outputs = {"train": _write(train_out, train), "heldout": _write(heldout_out, [unique[i][1] for i in held])}
        summary = {"data": str(data), "conversations": chats.records, "distinct_prompts": len(unique),
                   "train": len(train), "heldout": len(held), "seed": seed, "exclude": [str(p) for p in exclude],
                   "dropped_by_reason": dict(dropped.most_common()),
                   "fingerprint": sha256_json({"train": train, "heldout": [unique[i][1] for i in held]}),
                   "outputs": outputs}  # the record by which a rerun knows these files for its own
        with writing(_summary_path(train_out), "the split files are written: rerun with --force to record them"):
            write_atomic(_summary_path(train_out), dump_json(summary, indent=2) + "\n")
    return summary


def _summary_path(train_out: Path) -> Path:
    return Path(f"{train_out}.summary.json")


def _record(summary: Path) -> dict | None:
    """The record of the files an earlier holdout wrote, from its summary: {role: {"file", "xxh3_128"}}."""
    outputs = (object_or_none(summary, SUMMARY_BYTES) or {}).get("outputs")
    return outputs if isinstance(outputs, dict) else None


def _check_paths(data: Path, train_out: Path, heldout_out: Path, exclude: list[Path], force: bool) -> None:
    """The output rule (dspark.core.outputs), before any reading: no output is an input or another output, and an
    existing output is one this command wrote (its hash in the summary's record) unless --force."""
    for path in exclude:  # an input in two roles: every conversation would overlap itself
        distinct("--exclude", path, [("--data", data)], fix="pass the prompt files you report on, not --data")
    summary = _summary_path(train_out)
    record = _record(summary)
    hashes = {v.get("xxh3_128") for v in (record or {}).values() if isinstance(v, dict)}
    what = f"a file `dspark holdout` wrote (recorded in {summary.name})"
    outputs = [("--train", train_out, lambda p: file_xxh3(p) in hashes),
               ("--heldout-output", heldout_out, lambda p: file_xxh3(p) in hashes),
               ("--train's summary", summary, lambda p: record is not None)]
    inputs = [("--data", data), *(("--exclude", p) for p in exclude)]
    for flag, path, own in outputs:
        others = [(f, p) for f, p, _ in outputs if f != flag]
        check_output(flag, path, folder=False, taken=inputs + others, own=own, what=what, force=force)


def _write(path: Path, conversations: list[list[dict]]) -> dict:
    """Whole or not at all: a reader never sees part of the file. Returns its record (name and hash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, "the file it would replace is kept whole"), replacing(path) as f:
        for messages in conversations:
            f.write((json.dumps({"messages": messages}, ensure_ascii=False) + "\n").encode())
    return {"file": path.name, "xxh3_128": file_xxh3(path)}
