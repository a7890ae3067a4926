"""JSON that every parser reads back.

`json.dumps` writes NaN and infinity as the tokens `NaN` and `Infinity`, which are not JSON:
strict readers (jq, JavaScript, Go, `json.loads(..., parse_constant=...)`) refuse the whole
file. Result files (metrics.jsonl, eval.json, decode.json, run records, summaries, bench
outputs) and the CLI's printed JSON go through `dump_json`, which writes such a value as
null on purpose: a number that is undefined (a loss that diverged, a rate over nothing).

Reading: Python's parser recurses once per level of nesting, so hostile JSON nested 100k deep
raises RecursionError, a traceback. `loads` and `raw_decode` raise `JSONTooDeep` instead: a
`json.JSONDecodeError`, so every caller's existing "malformed JSON (msg at line/column)" line
covers it, pointing at where the nesting passes `MAX_JSON_DEPTH`.
Dependency-free, so any layer may use it.
"""

from __future__ import annotations

import json
import math
import re

# Nesting a reader is sure to accept: Python's parser stops near its recursion limit (1000, less
# the caller's stack), so deeper JSON may be refused; the error points where it passes this depth.
MAX_JSON_DEPTH = 500
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped whole) and brackets


class JSONTooDeep(json.JSONDecodeError):
    """JSON nested deeper than the parser can follow."""


def _too_deep(doc: str, pos: int) -> JSONTooDeep:
    depth = 0
    for m in _TOKENS.finditer(doc, pos):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(m.group(), 0)
        if depth > MAX_JSON_DEPTH:
            pos = m.start()
            break
    return JSONTooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels", doc, pos)


def loads(s: str | bytes, **kw):
    """`json.loads`, raising `JSONTooDeep` (a JSONDecodeError) where it would overflow the stack."""
    try:
        return json.loads(s, **kw)
    except RecursionError:
        raise _too_deep(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, 0) from None


def raw_decode(decoder: json.JSONDecoder, s: str, pos: int = 0):
    """`decoder.raw_decode(s, pos)`, raising `JSONTooDeep` where it would overflow the stack."""
    try:
        return decoder.raw_decode(s, pos)
    except RecursionError:
        raise _too_deep(s, pos) from None


def finite(obj):
    """`obj` with every float that JSON cannot hold (NaN, +-infinity) replaced by None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dump_json(obj, **kw) -> str:
    """`json.dumps(obj, **kw)` as strict JSON: NaN and infinity become null, never the tokens NaN/Infinity."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
