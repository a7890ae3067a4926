"""Refuse a verifier folder that cannot be built here, from its config.json, before anything is built.

transformers builds a model from config.json and only then loads the weights into it, so a damaged or
hand-edited size surfaced late: a tensor-shape traceback (`hidden_size` -128), a weight-loading
mismatch after the whole model was built (`vocab_size` 2**31), or minutes of building layers that have
no weights while memory grows (`num_hidden_layers` 100000). `check_verifier_config` reads config.json
and the safetensors headers (a few KB; no tensor is read) and names the field that is wrong.

Every place that builds a verifier calls it first: the transformers and vLLM extraction engines and
the decode verifier.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from dspark.core.errors import InputError
from dspark.verifier.info import CONFIG_FIX as _FIX, VerifierInfo, read_json_object

HEADER_LIMIT = 100 << 20  # a safetensors header's size limit, as the format sets it
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}  # others count 1 byte: a lower bound


def check_verifier_config(model: str | Path | VerifierInfo, dtype: str | None = None, host_memory: bool = True) -> None:
    """Raise `InputError` naming the field when `model`'s config.json cannot be built here.

    Checks: each size it gives is a positive integer; heads divide as attention needs; the embedding
    and layer count agree with the safetensors weights (when the folder has them); and, with
    `host_memory` (the weights are loaded into this machine's memory), the weights' size estimated
    from the config (a lower bound) fits the memory available. `dtype` is the one the model is loaded
    in; None or "auto": the config's own, else float32. `model`: its folder, or what was read of it.
    """
    info = model if isinstance(model, VerifierInfo) else VerifierInfo.load(model)
    folder, path, config = info.folder, info.path, info.config
    for name in SIZES:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise InputError(f"{path}: {name} {json.dumps(value)} is not a positive integer", _FIX)
    hidden, heads, kv = config.get("hidden_size"), config.get("num_attention_heads"), config.get("num_key_value_heads")
    if hidden and heads and not config.get("head_dim") and hidden % heads:
        raise InputError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                         "(and no head_dim is given)", _FIX)
    if heads and kv and heads % kv:
        raise InputError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}", _FIX)
    layers, types = config.get("num_hidden_layers"), config.get("layer_types")
    if layers and types is not None and (not isinstance(types, list) or len(types) != layers):
        have = f"{len(types)} entries" if isinstance(types, list) else f"the {type(types).__name__} {json.dumps(types)}"
        raise InputError(f"{path}: layer_types holds {have}, not one per layer (num_hidden_layers {layers})", _FIX)
    _check_weights(folder, path, config)
    if host_memory:
        _check_memory(path, config, info.dtype if dtype in (None, "auto") else dtype)


def _safetensors_header(path: Path) -> dict:
    """The tensor table at the start of a safetensors file: {name: {"dtype", "shape", ...}}."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > HEADER_LIMIT:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a table of tensors")
    except (OSError, ValueError, struct.error) as e:
        raise InputError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())[:200]})",
                         "download the model's weights again") from None
    return header


def _check_weights(folder: Path, path: Path, config: dict) -> None:
    """The embedding's shape and the layer count the weights hold against the config's sizes."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"{index} has no weight_map", "download the model's weights again")
        weights, names = index, list(weight_map)
    elif single.is_file():
        weight_map, weights = None, single
        header = _safetensors_header(single)
        names = [n for n in header if n != "__metadata__"]
    else:
        return  # other formats: transformers checks them as it loads
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        return  # not a Llama-style naming: nothing to compare
    if weight_map is not None:
        header = _safetensors_header(folder / str(weight_map[embed]))
    entry = header.get(embed) if isinstance(header.get(embed), dict) else {}
    shape = entry.get("shape")
    if isinstance(shape, list) and len(shape) == 2 and entry.get("dtype") in ("F32", "F16", "BF16"):  # not quantized
        wrong = [f"{name} {config[name]}" for name, have in zip(("vocab_size", "hidden_size"), shape)
                 if config.get(name) not in (None, have)]
        if wrong:
            raise InputError(f"{path}: {' and '.join(wrong)}, but {weights.name} holds {embed} of shape {shape}", _FIX)
    layers = re.compile(re.escape(embed.removesuffix("embed_tokens.weight")) + r"layers\.(\d+)\.")
    held = {int(m.group(1)) for n in names if (m := layers.match(n))}
    if held and (config.get("num_hidden_layers") or 0) > max(held) + 1:  # more may be held (MTP layers)
        raise InputError(f"{path}: num_hidden_layers {config['num_hidden_layers']}, but {weights.name} holds "
                         f"layers 0..{max(held)} only", _FIX)


def _check_memory(path: Path, config: dict, dtype: str | None) -> None:
    """The weights' size in `dtype` (None: float32), estimated from the config as a lower bound, against the
    memory available."""
    def get(name: str) -> int:  # sizes are positive integers or absent by now
        return config.get(name) or 0

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv, head_dim = get("num_key_value_heads") or heads, get("head_dim") or (hidden // heads if heads else 0)
    attention = 2 * hidden * head_dim * (heads + kv)  # q and o, k and v
    mlp = 2 * hidden * get("intermediate_size")  # up and down (a gated MLP has a third matrix)
    embeddings = get("vocab_size") * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    dtype = str(dtype or "float32").removeprefix("torch.")
    need = (embeddings + get("num_hidden_layers") * (attention + mlp)) * DTYPE_BYTES.get(dtype, 1)
    have = available_memory()
    if need > have:
        sizes = ", ".join(f"{n} {config[n]}" for n in SIZES if n in config)
        raise InputError(f"{path}: a verifier of these sizes ({sizes}) needs at least {need / 1e9:.1f} GB for its "
                         f"weights in {dtype}, more than the {have / 1e9:.1f} GB of memory available here",
                         "check config.json for a mistyped size, or run on a machine with more memory")


def available_memory() -> int:
    """Bytes of memory this machine can give a new allocation without swapping (Linux: MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
