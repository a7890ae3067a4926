"""Typed configs are the single source of every setting: a field's default, type, bounds and help.

`setting(...)` declares a field with what a command line and a config file need; `leaves`
flattens nested configs into their settings; `build` makes a config from a nested dict,
`load_config_file` reads one from YAML or JSON, and `check_settings` checks choices and
bounds. Nested configs become prefixed flags (`--mooncake-master` is `live.mooncake.master`
in a file) unless their field says `prefixed=False`.

Free of click and torch: a vLLM worker loading our connector reads its settings from here,
and `dspark.cli` (the only click user) turns the same leaves into options.
"""

from __future__ import annotations

import collections
import difflib
import json
import math
import shlex
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from dspark.core.errors import InputError
from dspark.core.files import FileRefused, read_bounded

SEP = "__"  # parameter names: live__mooncake__master <-> cfg.live.mooncake.master
MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few KB


def setting(default: Any = MISSING, help: str = "", *, flags: tuple[str, ...] = (), cli: bool = True,
            factory: Any = MISSING, negatable: bool = True, ge: float | None = None, gt: float | None = None,
            le: float | None = None, prefixed: bool = True, allow_inf: bool = False, result_neutral: bool = False,
            positional: bool = False, switch: Any = None, metavar: str | None = None, distinct: bool = False):
    """A config field with what its option needs (help, flag names, or no option at all) and its bounds.

    A float setting is finite: NaN never, infinity only where `allow_inf` says it means something.
    `le`: an upper bound, where a larger value would cost memory or time out of all proportion.
    `distinct`: a list setting that names each item once (a layer read twice is an error, not a wider model).
    `result_neutral`: changing it on a resume or replay changes nothing the run computes (a nested
    config's field marks all of its settings). `positional`: an argument, not a flag. `switch`: a
    flag without a value that sets this value (`--fp8` is `encoding: fp8_e4m3`).
    """
    meta = {"help": help, "flags": flags, "cli": cli, "negatable": negatable, "ge": ge, "gt": gt, "le": le,
            "prefixed": prefixed, "allow_inf": allow_inf, "result_neutral": result_neutral,
            "positional": positional, "switch": switch, "metavar": metavar, "distinct": distinct}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class Leaf(NamedTuple):
    """One setting of a (nested) config: where it sits, its flags, its field, type and effective default."""

    path: tuple[str, ...]
    flags: tuple[str, ...]
    field: Any
    hint: Any
    default: Any  # MISSING when required; a nested config's factory may override its class's default
    result_neutral: bool

    @property
    def meta(self):
        return self.field.metadata


def _default(f, parent) -> Any:
    if parent is not None:
        return getattr(parent, f.name)
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def leaves(cls, path: tuple[str, ...] = (), words: tuple[str, ...] = (), parent=None, neutral: bool = False):
    """Every leaf setting of `cls`, nested configs flattened (in field order).

    A nested config's flags carry its name (`--mooncake-master`) unless its field says
    `prefixed=False` (a run's live settings keep the seed's names: `--on-missing`).
    """
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        sub, is_neutral = hints[f.name], neutral or f.metadata.get("result_neutral", False)
        if is_dataclass(sub):
            words_ = (*words, f.name) if f.metadata.get("prefixed", True) else words
            yield from leaves(sub, (*path, f.name), words_, _default(f, parent), is_neutral)
        else:
            flag = f.metadata.get("flags") or ("--" + "-".join((*words, f.name)).replace("_", "-"),)
            yield Leaf((*path, f.name), flag, f, sub, _default(f, parent), is_neutral)


def cli_leaves(cls, prefix: tuple[str, ...] = ()) -> list[Leaf]:
    """The leaf settings that have a command-line option."""
    return [leaf for leaf in leaves(cls, prefix, prefix) if leaf.meta.get("cli", True)]


def base_type(hint):
    """`X` of `X | None` (either spelling), else `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    return hint


def check_finite(flag: str, value, default=None, allow_inf: bool = False) -> None:
    """NaN passes every `<`/`>` bound (it compares false) and infinity passes lower ones, so each number
    setting refuses them by name, as one line: NaN always, infinity unless `allow_inf`."""
    if isinstance(value, float) and not (math.isfinite(value) or allow_inf and math.isinf(value)):
        kind = "a number" if allow_inf else "a finite number"
        raise InputError(f"{flag} {value} must be {kind}",
                         "pass a finite value" + ("" if default is None else f" (default {default})"))


def check_settings(cfg, prefix: tuple[str, ...] = ()) -> None:
    """Every setting's choices, finiteness, `ge`/`gt`/`le` bounds and distinct items, as one line naming the flag
    and its value.

    Click checks finiteness on the command line and in config files; this also covers Python callers.
    """
    for path, flags, f, hint, default, _ in leaves(type(cfg), words=prefix):
        value = cfg
        for p in path:
            value = getattr(value, p)
        choices = typing.get_args(base_type(hint)) if typing.get_origin(base_type(hint)) is Literal else None
        if choices and value is not None and value not in choices:
            raise InputError(f"{flags[0]} {value!r} is not supported", f"use one of {list(choices)}")
        default = None if default is MISSING else default
        check_finite(flags[0], value, default, f.metadata.get("allow_inf", False))
        if f.metadata.get("distinct") and value is not None:
            check_distinct(flags[0], value)
        bound = broken_bound(f.metadata, value)
        if bound:
            shown = "" if default is None else f" (default {default})"
            raise InputError(f"{flags[0]} {value} must be {bound}", f"pass a value {bound}{shown}")


def broken_bound(meta: dict, value) -> str | None:
    """The `ge`/`gt`/`le` bound of a setting that `value` breaks, as "<= 1000", or None."""
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    if value is None or isinstance(value, str):  # a word a number setting also takes (`auto`)
        return None
    if (ge is not None and value < ge) or (gt is not None and value <= gt):
        return f">= {ge}" if ge is not None else f"> {gt}"
    return f"<= {le}" if le is not None and value > le else None


def check_distinct(flag: str, items: list) -> None:
    """Each item once: speculators refuses a layer listed twice (deep in model building); any order is fine,
    it is the order the drafter reads the layers in."""
    twice = sorted(x for x, n in collections.Counter(items).items() if n > 1)
    if twice:
        raise InputError(f"{flag} {' '.join(map(str, items))} lists {', '.join(map(str, twice))} more than once",
                         "list each layer once (in any order: the drafter reads them in the order given)")
    if not items:
        raise InputError(f"{flag} is empty", "list at least one layer, e.g. [1, 3]")


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """`{"live__mooncake__master": x}` -> `{"live": {"mooncake": {"master": x}}}`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(SEP)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _unknown(key: str, where: str, known) -> InputError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    return InputError(f"unknown setting {key!r} in {where}",
                      f"did you mean {close[0]!r}?" if close else f"the settings here are {sorted(known)}")


def build(cls, data: dict[str, Any], where: str = "config", base=None):
    """`cls` from a nested dict; an unknown key is an error naming it and the closest known one.

    Settings the dict leaves out keep `base`'s values (a nested config's own default instance).
    """
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key in sorted(set(data) - set(known)):
        raise _unknown(key, where, known)
    kw = {}
    for name, value in data.items():
        sub = hints[name]
        if is_dataclass(sub):
            if isinstance(value, sub):
                kw[name] = value
            elif isinstance(value, dict):
                inner = _default(known[name], base)
                kw[name] = build(sub, value, f"{where}.{name}", None if inner is MISSING else inner)
            else:
                raise InputError(f"{where}.{name} must be a mapping of settings, got {value!r}",
                                 f"allowed keys: {sorted(f.name for f in fields(sub))}")
        else:
            kw[name] = value
    if base is not None:
        return replace(base, **kw)
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in kw]
    if missing:
        raise InputError(f"{where} lacks required setting(s) {missing}", "set them as flags or in the config file")
    return cls(**kw)


def checked(cls, flat: dict[str, Any], where: str = "the command line"):
    """`cls` from flat `SEP`-joined names (a command line's parameters), its choices and bounds checked."""
    cfg = build(cls, nest(flat), where)
    check_settings(cfg)
    return cfg


# --- config files ----------------------------------------------------------------------------


def _load_yaml(text: str, path: Path):
    """`yaml.safe_load`, refusing aliases (`*name`): a few nested ones expand a few hundred bytes into
    billions of values (an "alias bomb"), and no setting needs one."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: a 1 MiB file in seconds, not a minute
    for event in yaml.parse(text, Loader=loader):  # events only: nothing is expanded yet
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1
            raise InputError(f"config file {path} uses a YAML alias (*{event.anchor}, line {line})",
                             "write the value out: config files refuse aliases")

    class UniqueKeys(loader):
        def construct_mapping(self, node, deep=False):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                if not isinstance(key, typing.Hashable):
                    continue  # the base class refuses it
                if key in lines:
                    raise _twice(path, key, f" (lines {lines[key]} and {line})")
                lines[key] = line
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeys)  # noqa: S506  (a safe loader)


def _twice(path: Path, key, where: str = "") -> InputError:
    """YAML and JSON keep the last of a key given twice, without a word: a file's typo would win silently."""
    return InputError(f"config file {path} sets {key!r} twice{where}", "keep one of them")


def _unique_pairs(path: Path):
    """json's object_pairs_hook: an object, refusing a key given twice (json has no line numbers to name)."""
    def hook(pairs: list) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise _twice(path, key, " in one object")
            out[key] = value
        return out
    return hook


# A deployment file (configs/cpu.yaml) configures several commands at once: a section per command,
# named as the command is, and `shared:` settings that every one of them takes where it has them.
# Which commands those are is dspark.deployment's table (it imports their configs; this module can't).
SHARED = "shared"


def _read_config(path: Path) -> dict:
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise InputError(f"config file {path} does not exist", "pass --config a YAML or JSON file") from None
    except FileRefused as e:  # a settings file is a few KB: a larger one would parse for minutes
        raise InputError(f"config file {path} {e}", "pass --config a YAML or JSON file of settings "
                                                    "(`dspark train --print-config` writes one)") from None
    try:
        data = json.loads(raw, object_pairs_hook=_unique_pairs(path)) if path.suffix == ".json" \
            else _load_yaml(raw.decode(), path)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001  (any parse error is the same user mistake)
        mark = getattr(e, "problem_mark", None)  # YAML's position; JSON's message carries its own
        at = f" (line {mark.line + 1})" if mark else ""
        raise InputError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}{at}: "
                         f"{str(e).splitlines()[0]}",
                         "fix the file (`dspark train --print-config` writes one)") from None
    if not isinstance(data, dict):
        raise InputError(f"config file {path} must hold a mapping of settings", "e.g. `lr: 0.001`")
    return data


def _mapping(value, where: str, path: Path, keys=None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where} in {path} must be a mapping", f"allowed keys: {sorted(keys)}" if keys else
                         "one `setting: value` per line, e.g. `target_layer_ids: [1, 3]`")
    return value


def _names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def _flatten(node: dict, cls, path: Path, prefix: tuple[str, ...] = (), label: tuple[str, ...] = (),
             by_name: dict[str, Leaf] | None = None) -> dict[str, Any]:
    """Nested settings of `cls` (as in a file) as flat `SEP`-joined names -> values typed as their flags take
    them; unknown keys and one key spelt twice (`a-b`, `a_b`) refused. `prefix`: where `cls` sits in the
    command's config (whose leaves are `by_name`); `label`: where `node` sits in the file."""
    by_name = {SEP.join(leaf.path): leaf for leaf in leaves(cls)} if by_name is None else by_name
    flat: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    spelt: dict[str, Any] = {}
    for key, value in node.items():
        name = str(key).replace("-", "_")
        where = ".".join((*prefix, name))
        if name not in known:
            raise _unknown(where, str(path), known)
        if name in spelt:
            raise _twice(path, ".".join((*label, name)), f" (as {spelt[name]!r} and {key!r})")
        spelt[name] = key
        if is_dataclass(hints[name]):
            flat.update(_flatten(_mapping(value, where, path, _names(hints[name])), hints[name], path,
                                 (*prefix, name), (*label, name), by_name))
        else:
            flat[SEP.join((*prefix, name))] = file_value(by_name[SEP.join((*prefix, name))], value, path,
                                                         ".".join((*label, name)))
    return flat


NOT = object()  # `typed`'s "not of this type" (None is a value)
_NOUNS = {int: "integer", float: "number", str: "string", bool: "true/false value"}


def typed(hint, value, strict: bool = False):
    """`value` as a setting of type `hint` takes it from a file, or `NOT`.

    The file's own type must be the setting's (YAML `true` is no port, and to Python a bool is an int),
    an int serving for a float; a string for a number is read as its flag reads the word (YAML 1.1 reads
    `1e-3` as a string), unless `strict` (a record dspark wrote itself holds numbers as numbers). A list
    setting takes a list, whose items are typed the same way.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return next((out for out in (typed(arm, value, strict) for arm in args) if out is not NOT), NOT)
    if hint is type(None):
        return None if value is None else NOT
    if value is None:
        return NOT
    if isinstance(value, bool):
        return value if hint is bool else NOT
    if hint in (int, float) and isinstance(value, str) and not strict:
        try:
            return hint(value)
        except ValueError:
            return NOT
    if hint is float and isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # an int past a float's range: check_finite names it
            return math.copysign(math.inf, value)
    if origin is Literal:
        return value if any(value == c and type(value) is type(c) for c in args) else NOT
    if origin is list:
        items = [typed(args[0], x, strict) for x in value] if isinstance(value, list) else [NOT]
        return NOT if any(x is NOT for x in items) else items
    if origin is dict:
        ok = isinstance(value, dict) and all(typed(args[0], k, strict) is k and typed(args[1], v, strict) is v
                                             for k, v in value.items())
        return value if ok else NOT
    if hint in (bool, int, float, str, dict, list):
        return value if isinstance(value, hint) else NOT
    return value  # a type with no file form to check


def expected(hint) -> str:
    """What a file must give for a setting of type `hint`, as an error line says it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(expected(arm) for arm in args)
    if origin is Literal:
        return f"one of {list(args)}"
    if origin is list:
        return f"a list of {_NOUNS.get(args[0], str(args[0]))}s"
    if origin is dict or hint is dict:
        return "a mapping"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(hint, str(hint))


def file_value(leaf: Leaf, value, path: Path, label: str):
    """`value` of setting `leaf` from config file `path` (at `label`, e.g. `launch-vllm.port`), typed as its
    flag takes it; anything else is one line naming the file, the key, the value and the type expected."""
    out = typed(leaf.hint, value)
    number = value if out is NOT else out
    if isinstance(number, float) and base_type(leaf.hint) in (int, float):  # NaN/inf: the flag's own line
        check_finite(leaf.flags[0], number, None if leaf.default is MISSING else leaf.default,
                     leaf.meta.get("allow_inf", False))
    if out is not NOT:
        return out
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    wanted = expected(leaf.hint)
    example = None if leaf.default in (MISSING, None) else json.dumps(leaf.default)
    fix = f"write {wanted}" + (f", e.g. `{leaf.path[-1]}: {example}` (its default)" if example else "")
    if isinstance(value, str) and typing.get_origin(base_type(leaf.hint)) is list:
        try:  # a string is not split: one word with a space in it would become two
            fix = f"write a YAML list: `{leaf.path[-1]}: {json.dumps(shlex.split(value))}`"
        except ValueError:
            fix = "write a YAML list, one item each"
    raise InputError(f"config file {path}: {label} is {shown}, expected {wanted}", fix)


def _groups(cls, prefix: tuple[str, ...] = ()):
    """(path, class) of `cls` and of every config nested in it."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            yield from _groups(hints[f.name], (*prefix, f.name))


def _deployment(data: dict, section: str | None, cls, path: Path, sections: dict) -> dict[str, Any]:
    """A command's settings in a deployment file: the shared ones it has (at any depth), then its section's.
    A shared key that no command of `sections` has is refused."""
    unknown = sorted(set(data) - {*sections, SHARED})
    if unknown:
        raise InputError(f"config file {path} has unknown section(s) {unknown}",
                         f"a deployment file holds `{SHARED}:` and sections named after {list(sections)}")
    if section not in sections:
        raise InputError(f"config file {path} is a deployment file, with no section for this command",
                         f"pass a file of this command's settings (sections are {list(sections)})")
    anywhere = {name for c in sections.values() for _, sub in _groups(c) for name in _names(sub)}
    by_name = {SEP.join(leaf.path): leaf for leaf in leaves(cls)}
    flat: dict[str, Any] = {}
    for key, value in _mapping(data.get(SHARED), SHARED, path).items():  # settings several commands have
        name = str(key).replace("-", "_")
        if name not in anywhere:  # every command would skip it
            raise _unknown(f"{SHARED}.{name}", str(path), anywhere)
        for prefix, sub in _groups(cls):  # e.g. `mooncake` is train's live.mooncake and launch-vllm's sink.mooncake
            if name in _names(sub):
                flat.update(_flatten({key: value}, sub, path, prefix, (SHARED,), by_name))
    flat.update(_flatten(_mapping(data.get(section), section, path, _names(cls)), cls, path, (), (section,), by_name))
    return flat


def load_config_file(path: str | Path, cls, section: str | None = None, sections: dict | None = None) -> dict[str, Any]:
    """A YAML or JSON file of `cls` settings (nested like `asdict`) as flat `SEP`-joined names -> values.

    A deployment file (top-level keys from `sections`, a section name -> its command's config class, and
    SHARED) gives the command named `section` its section, over the shared settings it has.
    """
    path = Path(path)
    data = _read_config(path)
    if sections and any(k in sections or k == SHARED for k in data) and not _names(cls) & set(data):
        return _deployment(data, section, cls, path, sections)
    return _flatten(data, cls, path)


# --- argparse, for entry points that run where click may be missing (vLLM's environment) ------------


def add_arguments(parser, cls, config_file: bool = True) -> None:
    """One argparse argument per leaf setting of `cls` that has one, plus `--config FILE` (`config_file`).

    Unset arguments stay unset (`SUPPRESS`), so `parsed_config` fills them from the file, then from the
    settings' own defaults: each default stays written once, on the setting.
    """
    import argparse

    if config_file:
        parser.add_argument("--config", dest="config_file", default=None, metavar="FILE",
                            help="YAML or JSON file of settings; flags override it.")
    for leaf in cli_leaves(cls):
        meta, base = leaf.meta, base_type(leaf.hint)
        dest = SEP.join(leaf.path)
        kw: dict[str, Any] = {"help": meta.get("help") or None, "default": argparse.SUPPRESS}
        if meta.get("positional"):
            parser.add_argument(dest, nargs="?", metavar=leaf.path[-1].upper(), **kw)
            continue
        if meta.get("switch") is not None:
            kw.update(action="store_const", const=meta["switch"])
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction if meta.get("negatable", True) else "store_true"
        elif typing.get_origin(base) is list:
            kw.update(nargs="+", type=_int_words if typing.get_args(base) == (int,) else str, metavar="N")
        elif typing.get_origin(base) is Literal:
            kw["choices"] = typing.get_args(base)
        else:
            kw.update(type=base if base in (int, float) else str, metavar=meta.get("metavar") or leaf.path[-1].upper())
        parser.add_argument(*leaf.flags, dest=dest, **kw)


def _int_words(word: str) -> list[int]:
    """`1,3` of `--target-layer-ids 1,3 5`; a word that is no integer list is argparse's usual error."""
    import argparse

    try:
        return [int(x) for x in word.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {word!r}") from None


def parsed_config(cls, namespace, where: str = "the command line", section: str | None = None,
                  sections: dict | None = None):
    """`cls` from what `add_arguments` parsed: given flags, then `--config FILE` (its `section` in a
    deployment file of `sections`), then the defaults."""
    given = dict(vars(namespace))
    path = given.pop("config_file", None)
    flat = load_config_file(path, cls, section, sections) if path else {}
    for key, value in given.items():
        flat[key] = [x for words in value for x in (words if isinstance(words, list) else [words])] \
            if isinstance(value, list) else value
    return checked(cls, flat, where)
