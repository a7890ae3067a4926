"""The prepare, extract and train commands that made a drafter, rebuilt from what its run recorded, with
local places as placeholders (`<verifier>`, `<prepared>`, ...) and nothing the run did not record."""

from __future__ import annotations

import json
import shlex
import typing
from dataclasses import MISSING
from pathlib import Path

from dspark.core.codec import CODECS, DEFAULT_CODEC
from dspark.export.provenance import Provenance
from dspark.verifier.hub import model_name

# Train settings that name a place on this machine or network, shown as placeholders.
TRAIN_PLACES = {"data_path": "<prepared>", "verifier_name_or_path": "<verifier>", "save_path": "<run>",
                 "store": "<store>", "draft_config": "<draft_config.json>", "live.endpoint": "<endpoint>",
                 "live.mooncake.master": "<mooncake-master>", "live.mooncake.local_hostname": "<this-host>",
                 "live.mooncake.metadata_server": "<metadata-server>"}
# Result-neutral train settings the command keeps: where the run's data came from (its source, run folder and,
# for a live run, the live settings). The others, which do not change the drafter, are left out.
_TRAIN_WHERE = ("source", "save_path", "live")


def shell_word(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(shell_word(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict,)):
        return shlex.quote(json.dumps(value))
    s = str(value)
    if s.startswith(("/", "~")):  # a local path no placeholder was given for
        return "<path>"
    return s if s.startswith("<") and s.endswith(">") else shlex.quote(s)


def wrap_words(words: list[str], width: int = 96) -> str:
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
            words.append(f"--{key.replace('_', '-')} {shell_word(c[key])}")
    if c.get("role_map"):
        rm = c["role_map"]
        words.append(f"--role-map {shell_word(json.dumps(rm) if isinstance(rm, dict) else rm)}")
    for flag in ("trust_remote_code", "strict", "skip_invalid_lines"):
        if c.get(flag):
            words.append(f"--{flag.replace('_', '-')}")
    data = c.get("data")
    return wrap_words(words), (Path(str(data)).name if data else None)


def extract_command(p: Provenance) -> tuple[str, list[str]]:
    """`dspark extract` from the store manifest (or the run's settings alone), and what it cannot know."""
    t = p.train or {}
    layers = (p.manifest or {}).get("target_layer_ids") or t.get("target_layer_ids") or []
    words = ["dspark extract --to zarr", "--model <verifier>", "--data <prepared>", "--store <store>",
             f"--target-layer-ids {shell_word(layers)}"]
    unknown = ["the engine (`--engine transformers` or `vllm`), device, batch sizes and sharding of the extraction "
               "(they are not recorded; the defaults are shown)"]
    m = p.manifest
    if m:
        words.append(f"--dtype {shell_word(m['dtype'])}")
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
            words.append(f"--chunk-tokens {shell_word(m['chunk_tokens'])}")
        verifier_dir = model_name(str(t.get("verifier_name_or_path") or ""))
        if m.get("verifier_name") and m["verifier_name"] != verifier_dir:
            words.append(f"--verifier-name {shell_word(m['verifier_name'])}")
    else:
        unknown.append("the store's dtype and encoding (bf16 or `--fp8`): its manifest is not here")
    if t.get("trust_remote_code"):
        words.append("--trust-remote-code")
    return wrap_words(words), unknown


def _flat(d: dict, groups: set[tuple[str, ...]], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """A recorded config as leaf path -> value; `groups`: the paths of its nested configs (`live`, `live.mooncake`)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and (*prefix, k) in groups:
            out.update(_flat(v, groups, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def train_command(p: Provenance) -> str:
    """`dspark train` with every recorded setting that shapes the drafter, local places as placeholders."""
    from dspark.kinds import DEFAULT_KIND, KINDS
    from dspark.connector.registry import is_live
    from dspark.core.settings import cli_leaves, leaves
    from dspark.train.config import TrainConfig

    groups = {leaf.path[:i] for leaf in leaves(TrainConfig) for i in range(1, len(leaf.path))}
    values = _flat({k: v for k, v in (p.train or {}).items() if k != "tracking"}, groups)
    live = is_live(values.get(("source",)))
    unread = KINDS[values.get(("speculator_type",), DEFAULT_KIND)].unread_settings()
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
        words.append(f"{flag} {shell_word(TRAIN_PLACES.get(dotted, value))}")
    for path, value in values.items():  # settings of a newer dspark than this one: shown by their names
        if path not in seen and path[0] != "live" and value is not None:
            flag = "--" + path[-1].replace("_", "-")
            words.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {shell_word(value)}")
    return wrap_words(words)
