"""Records dspark reads back, checked against a small typed schema before anything uses them.

A run's config.json, metrics.jsonl and trackers.json and a regenerate's OUTPUT.regenerate.json are
written by dspark, but a user, a broken copy or an older dspark may have left something else there.
Every reader of one goes through here: a bounded read of a regular file (`dspark.core.files`), strict
JSON, then the fields the reader uses: present, of their type, in their range. A failure is one
`InputError` naming the file and the field ("RUN/config.json: field train.epochs is 'x', expected an
integer >= 1"), never a traceback deep in the command that used the value. Fields a schema does not
name are left alone: a newer dspark may add some.

A schema is a dict of field name -> `Field`; a dataclass of settings gives its own (`settings_schema`:
each setting typed and bounded by `dspark.core.settings`' own rule), so a run's recorded `train` section is
held to what `dspark train` accepts. Dependency-free but for `dspark.core.settings`: any layer may use it.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

from dspark.core import jsonio, settings
from dspark.core.errors import InputError
from dspark.core.files import FileRefused, read_bounded

RECORD_LIMIT = 16 << 20  # bytes of one JSON record (dspark writes a few KiB): more is damage, not read
LOG_LIMIT = 1 << 30  # bytes of a run's metrics.jsonl (~0.5 KiB a log point: two million of them)


@dataclass(frozen=True)
class Field:
    expected: str  # what the error line says it should be
    ok: Callable[[Any], bool]
    required: bool = True
    schema: dict | None = None  # an object's own fields, checked in turn


def integer(ge: int | None = None) -> Field:
    return Field("an integer" + ("" if ge is None else f" >= {ge}"),
                 lambda v: type(v) is int and (ge is None or v >= ge))


def number_or_null() -> Field:
    """A number, or null: a result dspark wrote as null because it was not finite (`dspark.core.jsonio`)."""
    return Field("a number or null", lambda v: v is None or type(v) in (int, float))


def text() -> Field:
    return Field("a string", lambda v: isinstance(v, str))


def one_of(*choices) -> Field:
    return Field(f"one of {list(choices)}", lambda v: any(v == c and type(v) is type(c) for c in choices))


def list_of(item: Field) -> Field:
    return Field(f"a list of {item.expected}s", lambda v: isinstance(v, list) and all(item.ok(x) for x in v))


def mapping(schema: dict | None = None, values: Field | None = None) -> Field:
    """A JSON object: with the fields `schema` names, or (`values`) each value of one kind."""
    return Field("an object" + (f" of {values.expected}s" if values else ""),
                 lambda v: isinstance(v, dict) and (values is None or all(values.ok(x) for x in v.values())),
                 schema=schema)


def optional(f: Field) -> Field:
    """`f`, or the field left out."""
    return Field(f.expected, f.ok, False, f.schema)


def settings_schema(cls) -> dict:
    """The schema of a settings dataclass: each setting typed as `dspark.core.settings` types a config file's value
    (strictly: a record holds numbers as numbers) and within its bounds. Each may be left out: a record of an
    older dspark lacks the settings added since, which take their defaults."""
    hints = typing.get_type_hints(cls)
    return {f.name: optional(_setting(hints[f.name], f.metadata)) for f in fields(cls)}


def _setting(hint, meta) -> Field:
    if is_dataclass(hint):
        return mapping(settings_schema(hint))
    bounds = " and".join(f" {word} {meta[key]}" for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="))
                         if meta.get(key) is not None)
    return Field(settings.expected(hint) + bounds,
                 lambda v: settings.typed(hint, v, strict=True) is not settings.NOT
                 and not settings.broken_bound(meta, v if isinstance(v, (int, float)) else None))


def shown(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def check(data, schema: dict, where: str, fix: str, prefix: str = ""):
    """`data` if it is an object holding `schema`'s fields as they should be, else one line naming the first."""
    if not isinstance(data, dict):
        name = f"field {prefix[:-1]}" if prefix else "the record"
        raise InputError(f"{where}: {name} is {shown(data)}, expected an object", fix)
    for name, f in schema.items():
        if name not in data:
            if f.required:
                raise InputError(f"{where}: field {prefix}{name} is missing, expected {f.expected}", fix)
            continue
        value = data[name]
        if not f.ok(value):
            raise InputError(f"{where}: field {prefix}{name} is {shown(value)}, expected {f.expected}", fix)
        if f.schema is not None and value is not None:
            check(value, f.schema, where, fix, f"{prefix}{name}.")
    return data


def load_json(path: Path, fix: str, limit: int = RECORD_LIMIT):
    """The JSON value in regular file `path` (at most `limit` bytes), or one line saying why not."""
    try:
        raw = read_bounded(path, limit)
    except FileRefused as e:
        raise InputError(f"{path} {e}", fix) from None
    except OSError as e:
        raise InputError(f"{path} cannot be read ({e.strerror or e})", fix) from None
    try:
        return jsonio.loads(raw)
    except ValueError as e:  # JSONTooDeep and UnicodeDecodeError are ValueErrors
        raise InputError(f"{path} is not JSON ({str(e).splitlines()[0][:200]})", fix) from None


def object_or_none(path: Path, limit: int = RECORD_LIMIT) -> dict | None:
    """The JSON object in `path`, or None where there is none (missing, over `limit` bytes, not JSON, no object):
    for a record whose absence or damage only means "not written by this command" (an output's own record)."""
    try:
        value = jsonio.loads(read_bounded(path, limit))
    except (OSError, ValueError, FileRefused):  # ValueError: not JSON, not UTF-8, nested too deep
        return None
    return value if isinstance(value, dict) else None


def read_record(path: Path, schema: dict, fix: str):
    """A record file: bounded, JSON, and holding `schema`'s fields as they should be (or one line)."""
    return check(load_json(path, fix), schema, str(path), fix)


# --- the run folder -------------------------------------------------------------------------------

RUN_FIX = "restore the file from a copy of the run, or train into a new --save-path"
RUN_RECORD = "config.json"


def read_run(root: Path, schema: dict) -> dict | None:
    """RUN/config.json checked against `schema`, the fields its reader uses (None: there is none, the folder is
    no run yet)."""
    path = Path(root) / RUN_RECORD
    if not path.exists() and not path.is_symlink():
        return None
    return read_record(path, schema, RUN_FIX)

METRIC_RECORD = {"step": integer(0), "epoch": integer(0), "split": one_of("train", "val"),
                 "metrics": mapping(values=number_or_null()), "timing": optional(mapping(values=number_or_null())),
                 "live": optional(mapping(values=number_or_null())), "damaged_skipped": optional(integer(0))}


def check_metric_record(rec, path: Path, line: int) -> dict:
    return check(rec, METRIC_RECORD, f"{path} line {line}", "delete that line or restore the file")
