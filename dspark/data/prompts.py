"""Prompt sets for `dspark eval --decode`: what the verifier is asked, as token ids.

A set is a file or folder given as `name=path` or `path` (the name is then the stem). A file
may be gzipped (found by its magic bytes, whatever its name). Its format is detected from
the first record:

- a folder: prepared data (`dspark prepare`); the prompt is each sample's tokens before its
  first supervised (loss_mask == 1) token, i.e. exactly what training saw before a reply.
- LongBench JSONL (records with `context` and `input`; `dataset`, `length`, `_id`, `answers`,
  `all_classes`, `language` optional): one user message `LONGBENCH_TEMPLATE` (the context, a
  blank line, `Question: {input}`; the context alone when `input` is empty, as in LongBench's
  summarisation and code sets), rendered with the chat template and its generation prompt.
  `subdomain` is the record's `dataset`. LongBench's own per-dataset instructions are not
  used: speed, not answer quality, is measured, and one template keeps sets comparable.
- HumanEval JSONL (records with `task_id` and `prompt`, as `HumanEval.jsonl.gz` ships them;
  `entry_point`, `canonical_solution`, `test` unused): one user message `HUMANEVAL_TEMPLATE`
  ("Complete the following Python function:", then the record's `prompt`, the code to
  complete, in a ```python fence), rendered with the chat template and its generation prompt.
- MT-bench JSONL (records with `turns`, a list of user messages, as FastChat's
  `question.jsonl` ships them; `question_id`, `category`, `reference` optional): the prompt is
  the first turn alone, as one user message. The second turn asks about the model's own first
  answer, which the file does not hold, so it is not decoded. `subdomain` is `category`.
- anything else: chat JSONL or a JSON array, OpenAI `messages` or ShareGPT `conversations`,
  read by `dspark.data.prepare.read_conversations` (same roles, repairs and drop reasons as
  `dspark prepare`, but a conversation without an assistant turn is kept); the prompt is the
  conversation before its first assistant turn, or, in one without an assistant turn, the
  conversation up to and including its first user turn (the later user turns await replies
  the file does not hold, as in MT-bench). It is rendered with the generation prompt and
  tokenized as `prepare` tokenizes (no extra special tokens).

Prompts that cannot be used are counted in `PromptSet.dropped` by reason, never fatal one by
one: the reader's reasons (`empty`, `unknown_role:x`, ...), `no_user_turn` (nothing from the
user before the first reply), `chat_template_error`, `no_supervised_token`, `empty_prompt` (a
prepared sample supervised from its first token, a blank HumanEval prompt or MT-bench turn).
With `max_length` (the verifier's max_position_embeddings), a prompt longer than
`max_length - max_new_tokens` could not be decoded to the end: it is counted under a reason
naming that limit, and in `PromptSet.too_long` by (subdomain, context bucket), so a
LongBench report can say "beyond the verifier's maximum length" for a bucket it has no
numbers for. A set with no usable prompt is an `InputError`, except a LongBench set whose
prompts were all too long (its report is exactly that).

`max_prompts` keeps the first N usable prompts in file order and stops reading there, so the
drops counted are those met on the way (the chat reader's own drops cover the whole file).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from dspark.core import jsonio
from dspark.core.errors import InputError
from dspark.data.prepare import OVER_MAX_CHARS, open_data, too_many_chars

# Context buckets count tokens of the rendered prompt, K = 1024 (LongBench's own `length`
# counts words, K = 1000): power-of-two windows, so a 4096-token verifier ends at "2K-4K".
K = 1024
LONG_BUCKETS = ["<=2K", "2K-4K", "4K-8K", "8K-16K", "16K-20K", ">20K"]
_BUCKET_EDGES = [2 * K, 4 * K, 8 * K, 16 * K, 20 * K]  # inclusive upper edges of all but the last

LONGBENCH_TEMPLATE = "{context}\n\nQuestion: {input}"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"  # prompt ends in a newline
FORMATS = ("chat JSONL (`messages` or ShareGPT `conversations`), LongBench JSONL (`context`, `input`, "
           "`dataset`), HumanEval JSONL (`task_id`, `prompt`), MT-bench JSONL (`turns`, `category`) "
           "or a `dspark prepare` folder")


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]          # token ids of the rendered prompt, ending where the assistant's reply starts
    subdomain: str | None = None  # LongBench's `dataset`, MT-bench's `category`; None for other formats
    # the turns rendered (what a chat API is sent); None for a prepared folder, which holds token ids only
    messages: tuple[dict, ...] | None = field(default=None, compare=False)

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass
class PromptSet:
    name: str
    path: str
    prompts: list[Prompt]
    dropped: dict[str, int]  # reason -> count, too-long prompts included
    longbench: bool = False
    limit: int | None = None  # longest usable prompt: max_length - max_new_tokens (None: no limit)
    too_long: Counter = field(default_factory=Counter)  # (subdomain, context_bucket) -> prompts over `limit`
    format: str = "chat"  # "prepared", "chat", or a key of ONE_TURN_FORMATS

    def summary(self) -> dict:
        """JSON-ready counts for a report."""
        return {"name": self.name, "path": self.path, "format": self.format, "prompts": len(self.prompts),
                "longbench": self.longbench,
                "limit": self.limit, "dropped": dict(self.dropped),
                "too_long": {f"{sub or self.name}/{bucket}": n for (sub, bucket), n in sorted(
                    self.too_long.items(), key=lambda kv: (kv[0][0] or "", LONG_BUCKETS.index(kv[0][1])))}}


def context_bucket(length: int) -> str:
    """The LongBench-style bucket of a prompt of `length` tokens (upper edges inclusive)."""
    return LONG_BUCKETS[bisect_left(_BUCKET_EDGES, length)]


def parse_spec(spec: str) -> tuple[str, Path]:
    """`name=path` or `path` (named by its stem). A spec that exists as a path is a path, `=` or not."""
    name, sep, rest = spec.partition("=")
    if sep and not Path(spec).exists() and name and "/" not in name:
        if not rest:
            raise InputError(f"prompt set {spec!r} names no path", "write it as name=path or just path")
        return name, Path(rest)
    path = Path(spec)
    return (path.name if path.is_dir() else path.stem) or str(path), path


def too_long_reason(max_length: int, max_new_tokens: int) -> str:
    room = f" minus {max_new_tokens} new tokens" if max_new_tokens else ""
    return f"longer than the verifier's maximum length ({max_length}){room}"


def prompt_turns(messages: list[dict]) -> list[dict] | None:
    """The turns a reply answers: all before the first assistant turn; without one (questions only, as
    MT-bench), up to and including the first user turn, since the later ones await replies the file does
    not hold. None when those turns hold no user turn (counted as `no_user_turn`)."""
    roles = [m["role"] for m in messages]
    if "assistant" in roles:
        turns = messages[: roles.index("assistant")]
    else:
        turns = messages[: roles.index("user") + 1] if "user" in roles else messages
    return turns if any(m["role"] == "user" for m in turns) else None


def later_turns(messages: list[dict]) -> list[list[dict]]:
    """The turns each later reply answers: after each assistant turn, those up to the next one (and a last user
    turn the file holds no reply to), while each such stretch holds a user turn."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return []
    segments: list[list[dict]] = []
    current: list[dict] = []
    for m in messages[roles.index("assistant") + 1:]:
        if m["role"] != "assistant":
            current.append(m)
            continue
        if not any(t["role"] == "user" for t in current):
            return segments  # two replies in a row: what follows answers no question of its own
        segments.append(current)
        current = []
    if any(t["role"] == "user" for t in current):
        segments.append(current)
    return segments


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` plus the assistant's generation prompt, tokenized as `prepare` does."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def longbench_prompt(context: str, question: str) -> str:
    return LONGBENCH_TEMPLATE.format(context=context, input=question) if question.strip() else context


def humaneval_prompt(code: str) -> str:
    return HUMANEVAL_TEMPLATE.format(prompt=code if code.endswith("\n") else code + "\n")


def _longbench_ask(r: dict):
    if isinstance(r.get("context"), str) and isinstance(r.get("input"), str):
        return longbench_prompt(r["context"], r["input"]), r.get("dataset")


def _humaneval_ask(r: dict):
    if isinstance(r.get("prompt"), str):
        return humaneval_prompt(r["prompt"]), None


def _mtbench_ask(r: dict):
    turns = r.get("turns")
    if isinstance(turns, list) and all(isinstance(t, str) for t in turns):
        return (turns[0] if turns else ""), r.get("category")


class OneTurnFormat(NamedTuple):
    """A JSONL format whose records are one user message each."""

    title: str
    keys: set[str]  # fields that identify the format in a first record
    ask: Callable[[dict], tuple[str, object] | None]  # record -> (user message, subdomain); None: not a record
    needs: str  # what each record must hold, for the fix of a bad one


ONE_TURN_FORMATS = {
    "longbench": OneTurnFormat("LongBench", {"context", "input"}, _longbench_ask,
                               "string fields 'context' and 'input' (and 'dataset'), as LongBench's JSONL has"),
    "humaneval": OneTurnFormat("HumanEval", {"task_id", "prompt"}, _humaneval_ask,
                               "a string field 'prompt' (the code to complete), as HumanEval.jsonl.gz has"),
    "mtbench": OneTurnFormat("MT-bench", {"turns"}, _mtbench_ask,
                             "a list of strings 'turns' (and 'category'), as MT-bench's question.jsonl has"),
}


def load_prompt_set(spec: str, tokenizer, max_prompts: int | None = None, max_length: int | None = None,
                    max_new_tokens: int = 0, sample_ids: list[int] | None = None) -> PromptSet:
    """Read, render and filter one prompt set (see the module docstring). `sample_ids`: of a prepared folder,
    these samples only (a run's validation split)."""
    name, path = parse_spec(spec)
    if max_prompts is not None and max_prompts < 1:
        raise InputError(f"--max-prompts {max_prompts} keeps no prompt", "pass a positive number, or omit it")
    limit = None if max_length is None else max_length - max_new_tokens
    if limit is not None and limit < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the verifier's "
                         f"maximum length ({max_length})", f"pass --max-new-tokens below {max_length}")
    if not path.exists():
        raise InputError(f"prompt set {path} does not exist", f"pass {FORMATS}")
    kind = _detect(path)
    pset = PromptSet(name, str(path), [], Counter(), longbench=kind == "longbench", limit=limit, format=kind)
    if kind in ONE_TURN_FORMATS:
        prompts = _one_turn(path, tokenizer, pset.dropped, kind)
    elif kind == "prepared":
        prompts = _prepared(path, tokenizer, pset.dropped, sample_ids)
    else:
        prompts = _chat(path, tokenizer, pset.dropped)
    for prompt in prompts:
        if limit is not None and prompt.length > limit:
            pset.dropped[too_long_reason(max_length, max_new_tokens)] += 1
            pset.too_long[(prompt.subdomain, context_bucket(prompt.length))] += 1
            continue
        pset.prompts.append(prompt)
        if max_prompts is not None and len(pset.prompts) >= max_prompts:
            break
    pset.dropped = dict(pset.dropped.most_common())
    if not pset.prompts and not (pset.longbench and pset.too_long):
        counts = ", ".join(f"{reason}: {n}" for reason, n in pset.dropped.items()) or "it is empty"
        fix = ("lower --max-new-tokens or use a verifier with a longer context" if pset.too_long
               else f"pass {FORMATS}, with a user turn before each reply")
        raise InputError(f"prompt set {path} has no usable prompt ({counts})", fix)
    return pset


def _detect(path: Path) -> str:
    """'prepared', 'chat' or a key of `ONE_TURN_FORMATS`, from the folder or the first record."""
    if path.is_dir():
        return "prepared"
    with open_data(path) as f:
        lineno, first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), (1, b""))
    try:
        record = jsonio.loads(first.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "chat"  # a JSON array, or a broken line: the chat reader names the problem
    if isinstance(record, dict) and not {"messages", "conversations"} & record.keys():
        for kind, fmt in ONE_TURN_FORMATS.items():
            if fmt.keys <= record.keys():
                return kind
        raise InputError(f"{path}:{lineno} is none of the prompt formats (fields: {', '.join(sorted(record)[:8])})",
                         f"pass {FORMATS}")
    return "chat"


def _chat(path: Path, tokenizer, dropped: Counter) -> Iterator[Prompt]:
    from jinja2 import TemplateError

    from dspark.data.prepare import SKIP_FIX, read_conversations

    try:
        data = read_conversations(path, require_assistant=False)
    except InputError as e:  # the eval command has no --skip-invalid-lines to offer
        raise InputError(e.what, (e.fix or "").replace(f", {SKIP_FIX}", "") or None) from None
    dropped.update(data.dropped)
    for messages in data.conversations:
        turns = prompt_turns(messages)
        if turns is None:
            dropped["no_user_turn"] += 1
            continue
        try:
            yield Prompt(tuple(render_prompt(tokenizer, turns)), messages=tuple(turns))
        except TemplateError:
            dropped["chat_template_error"] += 1


def _one_turn(path: Path, tokenizer, dropped: Counter, kind: str) -> Iterator[Prompt]:
    """A JSONL file of `ONE_TURN_FORMATS[kind]` records, each one user message."""
    fmt = ONE_TURN_FORMATS[kind]
    with open_data(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = jsonio.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise InputError(f"{path}:{lineno}: not a JSON line ({type(e).__name__})",
                                 "fix or delete that line") from None
            asked = fmt.ask(record) if isinstance(record, dict) else None
            if asked is None:
                raise InputError(f"{path}:{lineno}: not a {fmt.title} record", f"each line needs {fmt.needs}")
            content, subdomain = asked
            if not content.strip():
                dropped["empty_prompt"] += 1
                continue
            if too_many_chars([content]):  # not rendered nor tokenized: neither has a bound on its time
                dropped[OVER_MAX_CHARS] += 1
                continue
            turns = ({"role": "user", "content": content},)
            yield Prompt(tuple(render_prompt(tokenizer, list(turns))), None if subdomain is None else str(subdomain),
                         turns)


def _prepared(path: Path, tokenizer, dropped: Counter, sample_ids: list[int] | None = None) -> Iterator[Prompt]:
    import numpy as np

    from dspark.verifier.fingerprint import tokenizer_hash
    from dspark.data.prepare import PreparedData

    data = PreparedData(path)
    source = Path(getattr(tokenizer, "name_or_path", "") or "")
    if str(source) and source.is_dir() and tokenizer_hash(source) != data.tokenizer_hash:
        raise InputError(f"{path} was prepared with another tokenizer than {source}'s",
                         "evaluate with the verifier the data was prepared for, or prepare it again with this one")
    for i in range(len(data)) if sample_ids is None else sample_ids:
        ids, mask = data.sample(i)
        supervised = np.flatnonzero(mask)
        if not len(supervised):
            dropped["no_supervised_token"] += 1
        elif supervised[0] == 0:
            dropped["empty_prompt"] += 1
        else:
            yield Prompt(tuple(ids[: supervised[0]].tolist()))
