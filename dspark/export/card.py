"""The model card (README.md) `dspark export` writes beside the drafter.

In the manner of a Hugging Face speculators drafter card: the verifier, the drafter's
specifications (from the checkpoint's config.json), how it was trained (the prepare, extract
and train commands rebuilt from what the run recorded: the run's config.json, the store's
manifest, the prepared folder's prepare.json; the final figures of metrics.jsonl), how to serve
it with vLLM (and the `method: dflash` trap), and the acceptance reports `dspark eval` wrote for
this very checkpoint.

The card names no local path: local folders become placeholders (`<verifier>`, `<chat.jsonl>`,
`<prepared>`, `<store>`, `<run>`), and what the run did not record is said to be unknown.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dspark.connector.registry import is_live
from dspark.core.report import EVAL_DIR, belongs_to
from dspark.export.commands import extract_command, prepare_command, shell_word, train_command, wrap_words
from dspark.export.provenance import Provenance, provenance, read_json, step_of
from dspark.export.serving import docker_command, serve_command, serving_notes, speculative_config
from dspark.kinds import kind_of

# The reports `dspark eval` and `dspark compare` write into CHECKPOINT/eval, and the figures export
# copies beside the card.
REPORTS = (("eval", "Teacher-forced acceptance (`dspark eval`)"),
           ("decode", "Speculative decoding (`dspark eval --decode`)"),
           ("compare", "Side by side with other drafters (`dspark compare`)"))
FIGURES = tuple(f"{name}.png" for name, _ in REPORTS)


_FIGURE_KEYS = (("loss", "loss"), ("ce_loss", "ce"), ("tv_loss", "tv"), ("accept_rate", "accept rate"),
                ("accept_len", "tau analytic"), ("eal", "tau greedy"), ("full_acc", "token accuracy"))


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def metrics_table(records: list[dict], best_step: int | None, step: int | None = None) -> str:
    """The last training window and validation up to this checkpoint (and the best checkpoint's, if another)."""
    rows = []
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    if train:
        rows.append(("train (last logged window)", train[-1]))
    if val:
        this = step is not None and val[-1].get("step") == step
        rows.append(("validation (this checkpoint)" if this else "validation (last)", val[-1]))
        best = [r for r in val if r.get("step") == best_step]
        if best and best[-1] is not val[-1]:
            rows.append(("validation (best checkpoint)", best[-1]))
    if not rows:
        return ""
    head = "| | step | epoch | " + " | ".join(label for _, label in _FIGURE_KEYS) + " |"
    sep = "|---|---:|---:|" + "---:|" * len(_FIGURE_KEYS)
    body = [f"| {name} | {r.get('step', '-')} | {r.get('epoch', '-')} | "
            + " | ".join(_num(r["metrics"].get(k)) for k, _ in _FIGURE_KEYS) + " |" for name, r in rows]
    return "\n".join([head, sep, *body])


def learning_curve(run: Path, records: list[dict], upto: int | None = None) -> list[dict]:
    """Validation tau and position 1's state gain over a run: each validation it logged, and `dspark eval` of the
    validation split at each checkpoint it did not validate (a --max-steps stop lands between validations).

    Tau: chained greedy where measured (runs since the state gain), else speculators' analytic accept length.
    Tokens: steps x the packed batch length, an upper bound."""
    batch = ((read_json(run / "config.json") or {}).get("train") or {}).get("total_seq_len")
    points = {}
    for r in records:
        if r.get("split") == "val" and isinstance(r.get("step"), int):
            m = r["metrics"]
            points[r["step"]] = (m.get("real_tau", m.get("accept_len")), m.get("state_gain_pos1_match"))
    for ckpt in (run / "checkpoints").glob("step-*"):
        step, e = step_of(ckpt), read_json(ckpt / EVAL_DIR / "eval.json")
        if step is not None and step not in points and (upto is None or step <= upto) and e and e.get("split") == "val":
            points[step] = (e.get("tau_greedy"), ((e.get("state_gain") or {}).get("positions") or [None])[0])
    return [{"step": step, "tokens": step * batch if batch else None, "tau": tau, "state_gain": gain}
            for step, (tau, gain) in sorted(points.items())]


def curve_table(curve: list[dict]) -> str:
    rows = [f"| {c['step']} | " + (f"{c['tokens'] / 1e6:.2f}M" if c["tokens"] else "-") + f" | {_num(c['tau'])} | "
            + (f"{c['state_gain']:+.3f}" if c["state_gain"] is not None else "-") + " |" for c in curve]
    return "\n".join(["| step | training tokens | validation tau | state gain pos 1 |", "|---:|---:|---:|---:|", *rows])


def _trend(curve: list[dict]) -> str:
    """Whether the last two points say more training would pay: the question a user reads the curve for."""
    taus = [c["tau"] for c in curve if c["tau"] is not None]
    if len(taus) < 2:
        return ""
    rise = taus[-1] - taus[-2]
    if rise > 0:
        return f" Still rising at the last point ({rise:+.3f}): more steps or more distinct data would pay."
    return f" Level or falling at the last point ({rise:+.3f}): more of the same data would not pay."


# --- acceptance reports -------------------------------------------------------------------------

_ABS_PATH = re.compile(r"(?<![\w.:/~<>])(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+")


def scrub(text: str, known: dict[str, str]) -> str:
    """`text` without local paths: the known ones as their placeholders, any other absolute one as `<path>`."""
    for path, placeholder in sorted(known.items(), key=lambda kv: -len(kv[0])):
        if path and path not in ("/", "."):
            text = text.replace(path, placeholder)
    return _ABS_PATH.sub("<path>", text)


def _demote(md: str, levels: int = 3) -> str:
    out, fenced = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def reports(ckpt: Path) -> tuple[list[tuple[str, str, dict, str, Path | None]], list[str]]:
    """The eval reports of `ckpt` (name, title, json, markdown, figure), and notes on those passed over."""
    found, skipped = [], []
    folder = ckpt / EVAL_DIR
    for name, title in REPORTS:
        data = read_json(folder / f"{name}.json")
        md = folder / f"{name}.md"
        if data is None or not md.is_file():
            continue
        if not belongs_to(data, ckpt):
            skipped.append(f"`{EVAL_DIR}/{name}.json` found beside this checkpoint belongs to another checkpoint "
                           "and is not shown.")
            continue
        png = folder / f"{name}.png"
        found.append((name, title, data, md.read_text(), png if png.is_file() else None))
    return found, skipped


def measured(ckpt: Path) -> dict | None:
    """The draft count this checkpoint's own decode report recommends for serving (None: none measured)."""
    found, _ = reports(ckpt)
    return next((data.get("recommendation") for name, _, data, *_ in found if name == "decode"), None)


def served_tokens(rec: dict | None, method: str, tokens: int) -> tuple[int, bool]:
    """(num_speculative_tokens, adaptive verification) to serve `method` with: the measured ones where the
    recommendation is for that method and names a count, else the checkpoint's `tokens`."""
    if rec and rec["method"] == method and rec["num_speculative_tokens"]:
        return rec["num_speculative_tokens"], bool(rec.get("enable_adaptive_verification"))
    return tokens, False


def _recommended_lines(rec: dict | None, method: str) -> list[str]:
    if not rec:
        return []
    adaptive = ", `enable_adaptive_verification: true`" if rec.get("enable_adaptive_verification") else ""
    used = " (the commands above use it)" if rec["method"] == method and rec["num_speculative_tokens"] else ""
    return [f"**Measured draft count** for `method: {rec['method']}`: `num_speculative_tokens` "
            f"{rec['num_speculative_tokens']}{adaptive}{used}. Why: {rec['why']}. `dspark serve-draft "
            "--num-speculative-tokens auto` serves it.", ""]


# --- the card -----------------------------------------------------------------------------------

def _specs(config: dict, verifier: str, p: Provenance) -> list[tuple[str, str]]:
    sc = config.get("speculators_config", {})
    tl = config.get("transformer_layer_config", {}) or {}
    kind = kind_of(config, "the drafter's config")
    block = kind.blocks  # the DFlash family drafts a block of slots
    anchor = config.get("sample_from_anchor", True)
    method = (sc.get("proposal_methods") or [{}])[0]
    verifier_vocab = tl.get("vocab_size") or (p.prepared or {}).get("vocab_size")
    draft_vocab = config.get("draft_vocab_size")
    vocab = f"{draft_vocab}" + (f" of the verifier's {verifier_vocab}" if verifier_vocab else "") + \
        (" (full vocabulary)" if draft_vocab == verifier_vocab else " (reduced: tokens outside it are never drafted)"
         if verifier_vocab else "")
    # EAGLE-3 configs name their layers under their own key
    layers = config.get("aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids") or []
    of = (p.manifest or {}).get("num_hidden_layers")
    verifier_hidden = config.get("target_hidden_size") or (p.manifest or {}).get("hidden_size")
    hidden = f"{tl.get('hidden_size', '?')}" + (f" (verifier: {verifier_hidden})" if verifier_hidden else "")
    arch = ", ".join(sc.get("verifier", {}).get("architectures") or [])
    decoder = (f"{tl.get('num_hidden_layers', '?')} x {tl.get('model_type', '?')} "
               f"({tl.get('num_attention_heads', '?')} heads, {tl.get('num_key_value_heads', '?')} KV heads, "
               f"head dim {tl.get('head_dim', '?')}, MLP {tl.get('intermediate_size', '?')})")
    rows = [
        ("Verifier", f"`{verifier}`" + (f" ({arch})" if arch else "")),
        ("Algorithm", f"{sc.get('algorithm', kind.name)} (speculators "
                      f"`{(config.get('architectures') or ['?'])[0]}`: {kind.summary})"),
        *([("Block size", str(config.get("block_size", "?")))] if block else []),
        ("Speculative tokens", str(method.get("speculative_tokens", "?")) + kind.tokens_note),
        *([("sample_from_anchor", "true (the anchor slot predicts the first draft token)" if anchor
            else "false (the anchor is the bonus token; the mask slots predict)")] if block else []),
        *kind.card_rows(config),  # the kind's own (DSpark's heads)
        ("Draft vocabulary", vocab),
        ("Draft decoder layers", decoder),
        ("Hidden size", hidden),
        ("Target layer ids", ", ".join(map(str, layers)) + (f" (of the verifier's {of} layers)" if of else "")),
        *([("Mask token id", str(config.get("mask_token_id", "?")))] if block else []),
        ("Weights dtype", str(config.get("dtype", "?"))),
        ("speculators version", str(config.get("speculators_version", "?"))),
    ]
    return rows


def _training(p: Provenance, ckpt: Path, verifier: str) -> list[str]:
    out = ["## Training", ""]
    if p.train is None:
        return out + p.notes + [""]
    t, rec = p.train, p.record or {}
    v = rec.get("versions", {})
    step = f"step {p.step}" if p.step is not None else f"checkpoint `{ckpt.name}`"
    out += [f"This drafter is {step} of a `dspark train` run on {rec.get('device', '?')} (world size "
            f"{rec.get('world_size', '?')}), {t.get('epochs', '?')} epoch(s) planned, with "
            + ", ".join(f"{k} {v[k]}" for k in ("dspark", "speculators", "torch", "transformers") if k in v) + ".", ""]
    if p.prepared:
        s = p.prepared.get("stats", {})
        out += [f"Data: {s.get('kept', '?')} of {s.get('conversations', '?')} conversations kept "
                f"({s.get('tokens', '?')} tokens, {s.get('supervised_tokens', '?')} of them assistant tokens the "
                f"loss covers), {round(100 * t.get('train_data_ratio', 0.9))}% trained on, the rest for "
                "validation.", ""]
    if p.manifest:
        m = p.manifest
        out += [f"Hidden states: the verifier's layers {', '.join(map(str, m.get('target_layer_ids', [])))} plus its "
                f"last layer (pre-norm), stored as {m.get('dtype', '?')}"
                + (" in fp8 e4m3 with per-token scales" if m.get("encoding") == "fp8_e4m3" else " (lossless)")
                + ".", ""]
    fp = [f"prepared data `{rec['prepared_fingerprint'][:16]}`" if rec.get("prepared_fingerprint") else None,
          f"hidden-state store `{rec['store_fingerprint'][:16]}`" if rec.get("store_fingerprint") else None]
    fp = [x for x in fp if x]
    if fp:
        out += ["Content fingerprints (a rerun on the same inputs reproduces them): " + ", ".join(fp) + ".", ""]

    out += ["### How it was made", "",
            "The commands below are rebuilt from what the run recorded. Local folders are placeholders: "
            f"`<verifier>` is the verifier's local folder (the Hugging Face model `{verifier}`), "
            "`<chat.jsonl>` the chat data, `<prepared>` the prepared data folder, `<store>` the hidden-state store, "
            "`<run>` the run folder.", "", "```bash"]
    unknown = []
    if p.prepared:
        cmd, name = prepare_command(p.prepared)
        out.append(cmd)
        if name:
            unknown.append(f"`<chat.jsonl>` was a file named `{name}`; its content is identified by the prepared "
                           "data fingerprint above")
    else:
        out.append("# dspark prepare: its settings were not found (see below)")
    if is_live(t.get("source")):
        out.append("")
        if (t.get("live") or {}).get("endpoint"):
            out.append("# hidden states were generated during training by an extraction server at <endpoint>")
            out.append("# (vLLM with dspark's KV connector, or `dspark serve`); its launch command is not recorded")
        else:
            out.append(wrap_words(["dspark extract --to mooncake", "--model <verifier>", "--data <prepared>",
                              f"--target-layer-ids {shell_word(t.get('target_layer_ids', []))}",
                              "--mooncake-master <mooncake-master>"]))
            unknown.append("the producer's Mooncake settings (its master address and memory)")
    else:
        cmd, more = extract_command(p)
        out += ["", cmd]
        unknown += more
    out += ["", train_command(p), "```", ""]
    if t.get("draft_config"):
        unknown.append("the content of `--draft-config` is not recorded, but the decoder layer it made is the "
                       "checkpoint's `transformer_layer_config`")
    unknown += [n.rstrip(".") for n in p.notes]
    if unknown:
        out += ["Not recorded, or not found when exporting:", "", *(f"- {u[0].upper() + u[1:]}." for u in unknown), ""]

    table = metrics_table(p.metrics, _best_step(p.run), p.step)
    if table:
        out += ["### Final training figures", "",
                "From the run's `metrics.jsonl` up to this checkpoint. tau is the mean acceptance length (with "
                "the bonus token): analytic (1-TV) and greedy.", "", table, ""]
    curve = learning_curve(p.run, p.metrics, p.step)
    if curve:
        out += ["### Learning curve", "",
                "Validation tau (greedy, each draft chained from the one before) and the state gain at position 1 "
                "(what the verifier's states bring) up to this checkpoint: each validation the run logged, and "
                "`dspark eval` of each checkpoint it did not validate." + _trend(curve), "", curve_table(curve), ""]
    return out


def _best_step(run: Path | None) -> int | None:
    if run is None or not (run / "best").exists():
        return None
    return step_of((run / "best").resolve())


def _acceptance(ckpt: Path, p: Provenance, known: dict[str, str]) -> tuple[list[str], list[tuple[Path, str]]]:
    found, skipped = reports(ckpt)
    out, copies = ["## Acceptance", ""], []
    names = {name for name, *_ in found}
    where = f"<run>/checkpoints/{ckpt.name}" if p.run else "<checkpoint>"
    for name, title, data, md, png in found:
        split = data.get("split")
        out += [f"### {title}", ""]
        if name == "eval":
            out += ["Supervised positions of the " + ("validation split" if split == "val" else "data")
                    + " scored as anchors, with the verifier's own hidden states (teacher-forced), each draft "
                    "chained from the one before as decoding does: per block position, the greedy match rate, the "
                    "analytic acceptance 1-TV, the chance of reaching that position, the confidence head's "
                    "prediction, and tau by context length. The state gain is what the verifier's states bring: "
                    "the greedy match with them minus with them zeroed or another sample's (the better of the two); "
                    "near zero, the drafter ignores its context.", ""]
        if name == "compare":
            out += [f"This drafter is the row `{data.get('row')}`.", ""]
        out += [_demote(scrub(md.strip(), known)), ""]
        if png is not None:
            out += [f"![{title}]({name}.png)", ""]
            copies.append((png, f"{name}.png"))
    out += [f"- {s}" for s in skipped] + ([""] if skipped else [])
    if "eval" not in names:
        out += ["No teacher-forced report for this checkpoint yet: `dspark eval --checkpoint "
                f"{where} --store <store>` writes one into the checkpoint's `eval/`; export again to include it.", ""]
    if "decode" not in names:
        out += ["No speculative-decoding report for this checkpoint yet: `dspark eval --checkpoint "
                f"{where} --decode --prompts [NAME=]<prompts>` measures real speculative decoding (per-position "
                "acceptance per data set, and by context length); export again to include it.", ""]
    return out, copies


def render(ckpt: Path, config: dict, verifier: str, export_dir: Path) -> tuple[str, list[tuple[Path, str]]]:
    """The card for checkpoint `ckpt` (resolved) with its exported `config`, and the figures to copy beside it."""
    from dspark.train.checkpoint import weight_count  # torch: the card's module stays light for the CLI

    p = provenance(ckpt)
    tokens = (config.get("speculators_config", {}).get("proposal_methods") or [{}])[0].get("speculative_tokens", 8)
    anchor = config.get("sample_from_anchor", True)
    known = {**p.places, str(export_dir.resolve()): "<export>",
             str(ckpt): f"<run>/checkpoints/{ckpt.name}" if p.run else "<checkpoint>"}
    n = weight_count(ckpt / "model.safetensors")
    kind = kind_of(config, f"{ckpt}/config.json")
    method = kind.vllm_method
    rec = measured(ckpt)
    tokens, adaptive = served_tokens(rec, method, tokens)
    lines = ["---", f"base_model: {verifier}", "tags:", "- speculators", "- dspark", "- speculative-decoding",
             "- draft-model", "---", "", f"# {kind.title} drafter for {verifier}", "",
             f"A speculative-decoding drafter for [`{verifier}`](https://huggingface.co/{verifier}) in the "
             "[speculators](https://github.com/vllm-project/speculators) format, trained with dspark on the "
             "verifier's own hidden states"
             + (f" ({n / 1e6:.2f} M parameters)." if n else "."), "",
             "## Specifications", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _specs(config, verifier, p)]
    first, *warning = serving_notes(config)
    lines += ["", "## Serving with vLLM", "", first, "",
              "```bash", serve_command(verifier, "<drafter>", tokens, method, adaptive), "```", "",
              "`<drafter>` is this folder (or its Hub id once uploaded). With Docker, this folder mounted at "
              "`/drafter`:", "",
              "```bash", docker_command(verifier, "<export>", tokens, method, adaptive), "```", ""]
    lines += _recommended_lines(rec, method)
    lines += [f"> {'**' if anchor else ''}{w}{'**' if anchor else ''}" for w in warning] + [""] * bool(warning)
    for other in kind.also_served_by(config):  # a DSpark drafter in DFlash's layout: `method: dflash` too
        lines += ["```bash", f"vllm serve {verifier} --speculative-config "
                  f"'{speculative_config('<drafter>', tokens, other)}'", "```", ""]
    acceptance, copies = _acceptance(ckpt, p, known)
    training = _training(p, ckpt, verifier)
    text = "\n".join(lines + acceptance + training).rstrip() + "\n"
    return scrub_card(text, known), copies


def scrub_card(text: str, known: dict[str, str]) -> str:
    """The last guard: every known local path replaced, whatever part of the card named it."""
    for path, placeholder in sorted(known.items(), key=lambda kv: -len(kv[0])):
        if len(path) > 1:
            text = text.replace(path, placeholder)
    return text
