"""A LongBench-format JSONL built from local text: the long-context decode path without downloads.

Two sub-domains, like LongBench's:
- `passage_retrieval`: numbered paragraphs of the source text, one holding a planted key
  sentence ("The secret number of the old bridge is 4821."); the question asks for it.
- `continuation`: a contiguous run of the source text; the question asks for what comes next.

Each record's prompt, rendered as `dspark.data.prompts` renders LongBench (chat template,
generation prompt), is at most its target length in tokens and close to it, so a target of
4096 lands in the "2K-4K" bucket and fits a 4096-position verifier with no room for new
tokens. `length` is the context's word count, as LongBench writes it.

    dspark longbench --output lb.jsonl --model cache/models/tiny --lengths 2048 4096
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dspark.data.prompts import longbench_prompt, render_prompt
from dspark.core.errors import InputError
from dspark.core.fsio import write_atomic
from dspark.core.settings import setting

# The longest context windows served today; a target past it would take minutes to build, and
# no verifier could read the prompt.
MAX_LENGTH = 1 << 20
THINGS = ["old bridge", "blue door", "silver key", "north tower", "red lantern", "quiet garden", "stone well"]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

# A record's parts from its first n units: (context, input, answers).
Build = Callable[[int], tuple[str, str, list[str]]]


@dataclass
class LongBenchConfig:
    """`dspark longbench`: a LongBench-format prompt file built from local text."""

    output: str = setting(help="The LongBench-format JSONL to write.")
    model: str = setting(help="Verifier folder or cached hub id (its tokenizer sizes the contexts).")
    texts: list[str] = setting(factory=list, flags=("--text",), help="Local text or chat JSONL to build contexts "
                                                                    "from (default: the shipped demo chat).")
    lengths: list[int] = setting(factory=lambda: [2048, 4096, 8192], help="Target prompt lengths in tokens.")
    per_length: int = setting(2, "Records per length and sub-domain.", ge=1)
    seed: int = setting(0)


def generate(texts: list[str], tokenizer, output: Path, lengths: list[int], per_length: int, seed: int) -> dict:
    """Write `per_length` records per target length and sub-domain to `output`; returns a summary."""
    sentences = [s if s[-1] in ".!?" else s + "." for t in texts for s in map(str.strip, _SENTENCE_END.split(t)) if s]
    if not sentences:
        raise InputError("the source texts hold no sentences", "pass --text files with some prose")
    if per_length < 1 or not lengths or min(lengths) < 1:
        raise InputError(f"--lengths {lengths} --per-length {per_length} asks for no record",
                         "pass positive target lengths and a positive --per-length")
    if max(lengths) > MAX_LENGTH:
        raise InputError(f"--lengths {max(lengths)} is longer than {MAX_LENGTH} tokens, the longest context windows "
                         "served", f"pass target lengths up to {MAX_LENGTH}")
    costs = [len(ids) for ids in tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]]
    rng = random.Random(seed)
    records, tokens = [], {}
    for target in lengths:
        for dataset, make in (("passage_retrieval", _retrieval), ("continuation", _continuation)):
            for j in range(per_length):
                (context, question, answers), n_tokens = _fit(tokenizer, target, *make(sentences, costs, target, rng))
                records.append({"_id": f"{dataset}-{target}-{j}", "dataset": dataset, "language": "en",
                                "length": len(context.split()), "context": context, "input": question,
                                "answers": answers, "all_classes": None})
                tokens.setdefault(target, []).append(n_tokens)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return {"output": str(output), "records": len(records),
            "datasets": dict(Counter(r["dataset"] for r in records)),
            "prompt_tokens": {str(t): [min(v), max(v)] for t, v in tokens.items()}}


def _continuation(sentences: list[str], costs: list[int], target: int, rng: random.Random):
    start = rng.randrange(len(sentences))
    order, total = [], 0
    while total < target or not order:  # enough units to fill the target, wrapping around the text
        i = (start + len(order)) % len(sentences)
        order.append(i)
        total += costs[i]

    def build(n: int):
        return (" ".join(sentences[i] for i in order[:n]), "Continue the text above with its next sentence.",
                [sentences[(order[n - 1] + 1) % len(sentences)]])
    return build, [costs[i] for i in order]


def _retrieval(sentences: list[str], costs: list[int], target: int, rng: random.Random):
    thing, number = rng.choice(THINGS), rng.randrange(1000, 10000)
    key = f"The secret number of the {thing} is {number}."
    where, inside = rng.random(), rng.random()  # fractions: the key stays planted as paragraphs are trimmed
    paragraphs, unit_costs = [], []
    while sum(unit_costs) < target or not paragraphs:
        start = rng.randrange(len(sentences))
        picked = [(start + k) % len(sentences) for k in range(4)]
        paragraphs.append([sentences[i] for i in picked])
        unit_costs.append(sum(costs[i] for i in picked) + 6)  # + "Paragraph N: " and the blank line

    def build(n: int):
        k = min(int(where * n), n - 1)
        paras = [list(p) for p in paragraphs[:n]]
        paras[k].insert(int(inside * (len(paras[k]) + 1)), key)
        context = "\n\n".join(f"Paragraph {i}: {' '.join(p)}" for i, p in enumerate(paras, 1))
        return context, f"What is the secret number of the {thing}, and which paragraph says it?", \
            [str(number), f"Paragraph {k + 1}"]
    return build, unit_costs


def _fit(tokenizer, target: int, build: Build, unit_costs: list[int]) -> tuple[tuple[str, str, list[str]], int]:
    """The most units whose rendered prompt is at most `target` tokens (at least one), and its length."""
    n, total = 0, 0
    while n < len(unit_costs) and total + unit_costs[n] <= target:
        total += unit_costs[n]
        n += 1
    n = max(n, 1)
    while True:
        parts = build(n)
        length = len(render_prompt(tokenizer, [{"role": "user", "content": longbench_prompt(*parts[:2])}]))
        if length <= target or n == 1:
            return parts, length
        over, cut = length - target, 0
        while n > 1 and cut < over:  # drop as many trailing units as the overshoot needs
            n -= 1
            cut += unit_costs[n]


def read_texts(path: Path) -> list[str]:
    """A text file's contents, or every turn of a chat JSONL/JSON file (read as `dspark prepare` reads it)."""
    if not path.is_file():
        raise InputError(f"--text {path} does not exist", "pass existing text or chat JSONL files")
    if path.suffix in (".jsonl", ".json"):
        from dspark.data.prepare import read_conversations

        return [m["content"] for conv in read_conversations(path).conversations for m in conv]
    try:
        return [path.read_text(encoding="utf-8")]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read --text {path} ({e})", "pass UTF-8 text files") from None
