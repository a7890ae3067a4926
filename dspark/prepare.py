"""`dspark prepare`: chat JSONL -> token ids + an assistant-only loss mask.

The loss mask comes from the model's own chat template: for each assistant turn
we render the conversation up to the turn's generation prompt and up to the end
of the turn; the characters in between are the assistant's, and the tokens that
cover them are supervised. This works for any template with the usual prefix
property, without `{% generation %}` markers.

Output folder (written to a temp folder, then renamed: never half-written):
  input_ids.npy  int32 [total_tokens]   all samples concatenated
  loss_mask.npy  uint8 [total_tokens]
  offsets.npy    int64 [num_samples+1]  sample i = [offsets[i], offsets[i+1])
  token_freq.pt  {token_id: count} over supervised tokens (draft-vocab input)
  prepare.json   config, stats, tokenizer hash and the data fingerprint
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cached_property
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dspark.errors import InputError
from dspark.fingerprint import sha256_files, sha256_json, tokenizer_hash

ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "human": "user", "gpt": "assistant", "tool": "tool"}
PREPARE_FORMAT = 1


@dataclass(frozen=True)
class PrepareConfig:
    model: str
    data: str
    output: str
    seq_length: int = 2048
    num_preprocessing_workers: int = 1
    minimum_valid_tokens: int = 1
    trust_remote_code: bool = False


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    """The verifier's tokenizer; refuses folders without one or without a chat template."""
    path = Path(model)
    if not path.is_dir():
        raise InputError(f"model folder {path} does not exist",
                         "pass --model a local folder holding config.json and the tokenizer files")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"could not load a tokenizer from {path}: {e}",
                         "the folder needs tokenizer.json (or the slow tokenizer files)") from e
    if not getattr(tok, "chat_template", None):
        raise InputError(f"the tokenizer in {path} has no chat template",
                         "add chat_template.jinja (or chat_template in tokenizer_config.json) to the model folder")
    return tok


def read_conversations(path: Path) -> list[list[dict]]:
    """Parse and validate every line; errors name the file and line."""
    if not path.is_file():
        raise InputError(f"data file {path} does not exist", "pass --data a chat JSONL file")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: malformed JSON ({e.msg} at column {e.colno})",
                                 "fix or delete that line") from None
            out.append(_normalize(record, where))
    if not out:
        raise InputError(f"data file {path} holds no conversations", "pass a non-empty chat JSONL file")
    return out


def _normalize(record, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object", 'write {"messages": [...]} per line')
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise InputError(f"{where}: no 'messages' (or ShareGPT 'conversations') field",
                         'write {"messages": [{"role": ..., "content": ...}]} per line')
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: empty conversation", "drop that line or give it at least one turn")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise InputError(f"{where}: turn {i} lacks '{role_key}' or '{text_key}'",
                             f"give every turn both '{role_key}' and '{text_key}'")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise InputError(f"{where}: turn {i} has unknown role {turn[role_key]!r}",
                             f"use one of {sorted(ROLES)}")
        messages.append({"role": role, "content": str(turn[text_key])})
    return messages


def tokenize_conversation(tokenizer, messages: list[dict], seq_length: int) -> tuple[list[int], list[int]]:
    """Token ids and the assistant-only loss mask, truncated to `seq_length`."""
    def render(msgs, gen_prompt=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)

    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], gen_prompt=True) if i else "", render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise InputError("the chat template does not render conversations prefix-wise, so "
                             "assistant tokens cannot be located", "use a template whose turns append")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:seq_length], enc["offset_mapping"][:seq_length]
    mask = [int(any(s < e_span and e > s_span for s_span, e_span in spans)) for s, e in offsets]
    return ids, mask


_worker_tok = None


def _init_worker(model: str, trust_remote_code: bool):
    global _worker_tok
    _worker_tok = load_tokenizer(model, trust_remote_code)


def _work(args):
    messages, seq_length = args
    return tokenize_conversation(_worker_tok, messages, seq_length)


def prepare(cfg: PrepareConfig, progress: bool = True) -> dict:
    """Run (or skip, if up to date) the preparation; returns the summary."""
    from tqdm import tqdm

    out = Path(cfg.output)
    model = Path(cfg.model)
    tok = load_tokenizer(model, cfg.trust_remote_code)
    convs = read_conversations(Path(cfg.data))
    inputs_key = sha256_json({"format": PREPARE_FORMAT, "data": sha256_files([Path(cfg.data)]),
                              "tokenizer": tokenizer_hash(model), "seq_length": cfg.seq_length,
                              "minimum_valid_tokens": cfg.minimum_valid_tokens})
    meta_path = out / "prepare.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("inputs_key") == inputs_key:
            return {**meta["stats"], "up_to_date": True}
    _check_writable(out)

    workers = max(1, cfg.num_preprocessing_workers)
    jobs = [(m, cfg.seq_length) for m in convs]
    bar = tqdm(total=len(jobs), desc="prepare", unit="conv", disable=not progress)
    if workers == 1:
        results = []
        for m, s in jobs:
            results.append(tokenize_conversation(tok, m, s))
            bar.update()
    else:
        with get_context("spawn").Pool(workers, _init_worker, (str(model), cfg.trust_remote_code)) as pool:
            results = []
            for r in pool.imap(_work, jobs, chunksize=16):  # imap keeps input order: deterministic
                results.append(r)
                bar.update()
    bar.close()

    kept_ids, kept_mask, dropped = [], [], Counter()
    freq: Counter = Counter()
    for (ids, mask), messages in zip(results, convs):
        valid = sum(mask)
        if not any(m["role"] == "assistant" for m in messages):
            dropped["no_assistant_turn"] += 1
        elif valid < cfg.minimum_valid_tokens:
            dropped["below_minimum_valid_tokens"] += 1
        else:
            kept_ids.append(ids)
            kept_mask.append(mask)
            freq.update(t for t, m in zip(ids, mask) if m)
    if not kept_ids:
        raise InputError(f"every conversation in {cfg.data} was dropped ({dict(dropped)})",
                         "lower --minimum-valid-tokens or raise --seq-length")

    input_ids = np.fromiter((t for s in kept_ids for t in s), dtype=np.int32)
    loss_mask = np.fromiter((m for s in kept_mask for m in s), dtype=np.uint8)
    offsets = np.zeros(len(kept_ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in kept_ids])
    stats = {"conversations": len(convs), "kept": len(kept_ids), "dropped": sum(dropped.values()),
             "dropped_by_reason": dict(dropped), "tokens": int(len(input_ids)),
             "supervised_tokens": int(loss_mask.sum()),
             "truncated": sum(1 for ids, _ in results if len(ids) == cfg.seq_length)}
    fingerprint = hashlib.sha256(input_ids.tobytes() + loss_mask.tobytes() + offsets.tobytes()).hexdigest()
    meta = {"format": PREPARE_FORMAT, "config": asdict(cfg), "inputs_key": inputs_key,
            "tokenizer_hash": tokenizer_hash(model), "fingerprint": fingerprint,
            "vocab_size": len(tok), "stats": stats}
    _write_atomically(out, {"input_ids.npy": input_ids, "loss_mask.npy": loss_mask, "offsets.npy": offsets},
                      dict(freq), meta)
    return {**stats, "up_to_date": False}


def _check_writable(out: Path) -> None:
    """Fail before the work, not after it: can we create files beside `out`?"""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise InputError(f"output folder {out} is not writable ({e.strerror or e})",
                         "choose a --output you can write to") from None


def _write_atomically(out: Path, arrays: dict, freq: dict, meta: dict) -> None:
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, arr in arrays.items():
            np.save(tmp / name, arr)
        torch.save(freq, tmp / "token_freq.pt")
        (tmp / "prepare.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class PreparedData:
    """Read-only view of a prepared folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / "prepare.json"
        if not meta_path.exists():
            raise InputError(f"{self.path} is not a prepared data folder (no prepare.json)",
                             "run `dspark prepare --output` on your chat data first")
        self.meta = json.loads(meta_path.read_text())
        self.fingerprint: str = self.meta["fingerprint"]
        self.tokenizer_hash: str = self.meta["tokenizer_hash"]
        self.offsets = np.load(self.path / "offsets.npy")

    @cached_property
    def input_ids(self) -> np.ndarray:
        return np.load(self.path / "input_ids.npy", mmap_mode="r")

    @cached_property
    def loss_mask(self) -> np.ndarray:
        return np.load(self.path / "loss_mask.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def token_ids(self, i: int) -> np.ndarray:
        return self.sample(i)[0]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.input_ids[s:e], dtype=np.int64), np.asarray(self.loss_mask[s:e])

    def token_freq(self) -> dict[int, int]:
        import torch

        return torch.load(self.path / "token_freq.pt", weights_only=True)
