"""A verifier named as users name it: a local folder, or a hub id found in the Hugging Face cache.

dspark is offline-first: it never downloads a model. But the seed's command lines pass hub ids
(`moonshotai/Kimi-K3`), and users keep models where vLLM and transformers find them, in the
Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`, or vLLM's `--download-dir`). `local_model` turns
either form into the folder every command reads, and `model_name` gives the name stores and
manifests are called by (a cached snapshot's folder is a commit hash, not a name).
"""

from __future__ import annotations

from pathlib import Path

from dspark.core.errors import InputError


def local_model(name_or_path: str | Path, cache_dir: str | Path | None = None, revision: str | None = None) -> Path:
    """The model's local folder: `name_or_path` itself when it is a folder, else the snapshot the
    Hugging Face cache holds for that hub id (`revision`, default main), looked up without network."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    import huggingface_hub
    from huggingface_hub import constants

    cache = Path(cache_dir).expanduser() if cache_dir else Path(constants.HF_HUB_CACHE)
    found = None
    try:
        found = huggingface_hub.try_to_load_from_cache(str(name_or_path), "config.json", cache_dir=cache,
                                                       revision=revision)
    except ValueError:  # not a hub id either (HFValidationError is a ValueError): a mistyped path
        pass
    if isinstance(found, str):
        return Path(found).parent
    at = f"revision {revision} of " if revision else ""
    raise InputError(f"{name_or_path} is neither a local folder nor {at}a model in the Hugging Face cache at {cache}",
                     "pass the model's folder, or download it first (`huggingface-cli download "
                     f"{name_or_path}`, or vLLM's --download-dir), or set HF_HOME to the cache that holds it")


def model_name(folder: str | Path) -> str:
    """The name a model folder goes by: its own name, or for a Hugging Face cache snapshot
    (`models--ORG--NAME/snapshots/<commit>`) the repo's name. The path is taken as given (callers
    decide whether links are followed)."""
    path = Path(folder)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.split("--")[-1]
    return path.name
