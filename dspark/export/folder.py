"""`dspark export`: a checkpoint -> a folder vLLM loads, naming the verifier portably.

The output folder must be new or empty, or hold an earlier export of the same checkpoint
(only the files export writes, with the same weights): rerunning an export is then a no-op
in effect. Anything else is refused unless --force, which overwrites export's own files and
leaves any others in place. Every file is written new and renamed into place: a symlink in the
folder is replaced, never written through (it could point anywhere), and a reader never sees half a file.
The checkpoint is verified first (its checksums, its config): a damaged one is never shipped.

README.md is a model card (card.py): the verifier, the drafter's specifications, how
it was made (the prepare/extract/train commands rebuilt from the run's records, no local path),
how to serve it, and the acceptance reports `dspark eval` wrote for this checkpoint, whose
figures are copied beside it.
"""

from __future__ import annotations

import filecmp
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dspark.core.errors import InputError
from dspark.core.settings import setting
from dspark.kinds import kind_of
from dspark.export.card import FIGURES, measured, render, served_tokens
from dspark.export.serving import SERVING_FILE, docker_command, serve_command, terminal_note

# The files export writes (besides the checkpoint's *.py): a rerun may rewrite them, --force overwrites them.
EXPORT_FILES = {"config.json", "model.safetensors", "README.md", SERVING_FILE, *FIGURES}


@dataclass
class ExportConfig:
    """`dspark export`: a checkpoint as a vLLM-loadable drafter folder."""

    checkpoint: str = setting(help="A checkpoint folder, e.g. RUN/latest.", positional=True)
    output: str = setting(help="The drafter folder to write.")
    verifier_name: str = setting(help="How vLLM users name the verifier, e.g. Org/Model.")
    force: bool = setting(False, "Write into a non-empty --output that is not an export of CHECKPOINT.",
                          negatable=False)


def _absolute_paths(obj, where="config") -> list[str]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _absolute_paths(v, f"{where}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _absolute_paths(v, f"{where}[{i}]")]
    return [where] if isinstance(obj, str) and (obj.startswith("/") or obj.startswith("./") or obj.startswith("~")) else []


def _check_output(out: Path, src: Path, force: bool) -> None:
    if out.is_symlink() and not out.exists():
        raise InputError(f"--output {out} is a symlink to {os.readlink(out)}, which does not exist",
                         "create that folder, or pass a new or empty folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"--output {out} is a file", "pass a folder (new or empty)")
    present = {p.name for p in out.iterdir()} if out.exists() else set()
    if not present or force:
        return
    ours = EXPORT_FILES | {p.name for p in src.glob("*.py")}
    if present <= ours and "model.safetensors" in present and \
            filecmp.cmp(src / "model.safetensors", out / "model.safetensors", shallow=False):
        return  # an earlier export of this checkpoint
    raise InputError(f"--output {out} is not empty and is not an export of {src}",
                     "pass a new or empty folder, or --force to overwrite the files export writes there")


def export(checkpoint: str, output: str, verifier_name: str, force: bool = False) -> dict:
    from dspark.core.fsio import copy_atomic, write_atomic
    from dspark.train.checkpoint import read_config, require_checkpoint

    src = require_checkpoint(checkpoint)
    if not verifier_name or verifier_name.startswith(("/", ".", "~")):
        raise InputError(f"--verifier-name {verifier_name!r} is a local path",
                         "name the verifier as vLLM users will load it, e.g. Org/Model")
    config = read_config(src)
    kind = kind_of(config, f"{src}/config.json")
    kind.require_servable(config, src)  # e.g. a DSpark Markov head vLLM would load wrong
    method = kind.vllm_method
    config["speculators_config"]["verifier"]["name_or_path"] = verifier_name
    config.pop("_name_or_path", None)
    leftover = _absolute_paths(config)
    if leftover:
        raise InputError(f"the checkpoint config still holds local paths at {', '.join(leftover)}",
                         "report this: an exported config must not name local files")
    out = Path(output)
    _check_output(out, src, force)
    out.mkdir(parents=True, exist_ok=True)
    copy_atomic(src / "model.safetensors", out / "model.safetensors")
    for code in src.glob("*.py"):  # speculators' save_pretrained ships its config class beside config.json
        copy_atomic(code, out / code.name)
    write_atomic(out / "config.json", json.dumps(config, indent=2))
    rec = measured(src)
    tokens, adaptive = served_tokens(rec, method, config["speculators_config"]["proposal_methods"][0]
                                     ["speculative_tokens"])
    card, figures = render(src, config, verifier_name, out)
    for name in FIGURES:  # a figure of an earlier export whose report no longer matches goes
        (out / name).unlink(missing_ok=True)
    for figure, name in figures:
        copy_atomic(figure, out / name)
    if rec:  # what `serve-draft --num-speculative-tokens auto` serves it with
        write_atomic(out / SERVING_FILE, json.dumps(rec, indent=2))
    else:
        (out / SERVING_FILE).unlink(missing_ok=True)  # an earlier export's, measured on another report
    write_atomic(out / "README.md", card)
    return {"export": str(out), "verifier": verifier_name,
            "serve": serve_command(verifier_name, str(out), tokens, method, adaptive),
            "docker": docker_command(verifier_name, str(out.resolve()), tokens, method, adaptive),
            "note": terminal_note(config),
            "files": sorted(["config.json", "model.safetensors", "README.md", *(n for _, n in figures),
                             *([SERVING_FILE] if rec else []),
                             *(p.name for p in src.glob("*.py"))])}
