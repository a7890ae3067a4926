"""JSON that every parser reads back.

`json.dumps` writes NaN and infinity as the tokens `NaN` and `Infinity`, which are not JSON:
strict readers (jq, JavaScript, Go, `json.loads(..., parse_constant=...)`) refuse the whole
file. Result files (metrics.jsonl, eval.json, decode.json, run records, summaries, bench
outputs) and the CLI's printed JSON go through `dump_json`, which writes such a value as
null on purpose: a number that is undefined (a loss that diverged, a rate over nothing).
Dependency-free, so any layer may use it.
"""

from __future__ import annotations

import json
import math


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
