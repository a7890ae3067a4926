"""vLLM's speculative-decoding counters, read from a server's Prometheus `/metrics` text.

vLLM (V1) exports, per engine and served model (labels `engine`, `model_name`):

    vllm:spec_decode_num_drafts_total                 verifier steps that carried drafts
    vllm:spec_decode_num_draft_tokens_total           draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total        draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}   accepted at draft position k (0-based)

They only grow, so what one set of requests did is the difference of two readings (a counter that
went back means the server restarted between them: refused, never a negative count). Label sets
(engines, data-parallel ranks, served names) are summed. The per-position rate is accepted at
position k over drafts, as `dspark eval --decode` and vLLM's own dashboards count it; the mean
acceptance length adds the verifier's own token: 1 + accepted / drafts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PREFIX = "vllm:spec_decode_"
MAX_COUNT = 2**53      # counts are exact in the floats Prometheus writes up to here; no server counts further
MAX_POSITIONS = 256    # draft positions a reading may hold: far past any num_speculative_tokens vLLM runs
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus' text format; comments and bad lines are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, value))
    return out


def count(value, what: str) -> int:
    """`value` as a count (a whole number from 0 to MAX_COUNT); anything else is a ValueError naming `what`: a
    server's numbers are checked for sense, never summed into a negative or infinite figure."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_COUNT \
            or value != int(value):
        raise ValueError(f"{what} is {str(value)[:40]}, not a count (a whole number from 0 to {MAX_COUNT})")
    return int(value)


@dataclass(frozen=True)
class SpecCounters:
    """One reading of the counters (or the difference of two)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: tuple[int, ...] = field(default_factory=tuple)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(before.per_position))
        pad = lambda p: (*p, *(0,) * (n - len(p)))  # noqa: E731
        pairs = {"num_drafts": (self.drafts, before.drafts),
                 "num_draft_tokens": (self.draft_tokens, before.draft_tokens),
                 "num_accepted_tokens": (self.accepted, before.accepted),
                 **{f'num_accepted_tokens_per_pos{{position="{k}"}}': ab
                    for k, ab in enumerate(zip(pad(self.per_position), pad(before.per_position)))}}
        for name, (a, b) in pairs.items():
            if a < b:
                raise ValueError(f"{PREFIX}{name} went back from {b} to {a}")
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.per_position), pad(before.per_position))))

    def summary(self) -> dict:
        """What `dspark eval --decode` reports for a set: counts, per-position rates, mean acceptance length."""
        steps = max(self.drafts, 1)
        reached = [self.drafts, *self.per_position[:-1]]
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
                "mean_acceptance_length": 1 + self.accepted / steps,
                "positions": [{"position": k + 1, "accepted": a, "rate": a / steps,
                               "conditional": a / max(reached[k], 1)} for k, a in enumerate(self.per_position)]}


@dataclass(frozen=True)
class Reading:
    """What one GET /metrics told: whether it is vLLM's at all, and its spec-decode counters if it has them."""

    is_vllm: bool
    spec: SpecCounters | None  # None: the server runs without speculative decoding


def read(text: str) -> Reading:
    """The counters in a /metrics text; a spec-decode sample that is not a count, or a draft position past
    MAX_POSITIONS, is a ValueError: no vLLM writes one, so nothing this server counts can be trusted."""
    samples = parse(text)
    is_vllm = any(name.startswith("vllm:") for name, _, _ in samples)
    names = {name for name, _, _ in samples}
    if not any(n.startswith(PREFIX) for n in names):
        return Reading(is_vllm, None)
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    keys = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
    per_pos: dict[int, int] = {}
    for name, labels, value in samples:
        if not name.startswith(PREFIX) or name.endswith("_created"):
            continue
        base = name[len(PREFIX):].removesuffix("_total")
        position = labels.get("position", "")
        if base == "num_accepted_tokens_per_pos" and position.isdigit():
            # the length first: int() of a digit string thousands long is itself refused (or slow)
            if len(position) > len(str(MAX_POSITIONS)) or int(position) >= MAX_POSITIONS:
                raise ValueError(f'{name}{{position="{position[:20]}"}}: a draft position past {MAX_POSITIONS - 1}, '
                                 "which no speculative decoding reaches")
            k = int(position)
            per_pos[k] = count(per_pos.get(k, 0) + count(value, name), f'{name}{{position="{k}"}} summed')
        elif base in keys:
            totals[keys[base]] = count(totals[keys[base]] + count(value, name), f"{name} summed")
    positions = tuple(per_pos.get(k, 0) for k in range(max(per_pos) + 1)) if per_pos else ()
    return Reading(is_vllm, SpecCounters(totals["drafts"], totals["draft_tokens"], totals["accepted"], positions))
