"""Typed configs are the single source of every setting: their fields make the CLI options.

A field's default, type and help live on the dataclass (`setting(...)`); `options(cls)`
turns the fields into click options, and `load_config_file` reads the same fields from a
YAML or JSON `--config FILE`. Nested configs (a run's live source, its Mooncake client)
become prefixed flags, so `--mooncake-master` is `live.mooncake.master` in a file.

Torch-free on purpose: the CLI builds its options from these classes at start-up.
"""

from __future__ import annotations

import difflib
import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import click

from dspark.errors import InputError
from dspark.files import FileRefused, read_bounded

SEP = "__"  # click parameter names: live__mooncake__master <-> cfg.live.mooncake.master
MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few KB


def setting(default: Any = MISSING, help: str = "", *, flags: tuple[str, ...] = (), cli: bool = True,
            factory: Any = MISSING, negatable: bool = True, ge: float | None = None, gt: float | None = None,
            prefixed: bool = True, allow_inf: bool = False):
    """A config field with what its CLI option needs (help, flag names, or no option at all) and its bounds.

    A float setting is finite: NaN never, infinity only where `allow_inf` says it means something.
    """
    meta = {"help": help, "flags": flags, "cli": cli, "negatable": negatable, "ge": ge, "gt": gt,
            "prefixed": prefixed, "allow_inf": allow_inf}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class MooncakeConfig:
    """The seed's Mooncake flags (`--mooncake-*`)."""

    master: str = setting("127.0.0.1:50051", "Mooncake master address.")
    metadata_server: str = setting("P2PHANDSHAKE", "Transfer-engine metadata server.")
    protocol: Literal["tcp", "rdma"] = setting("tcp", "Transport.")
    device: str = setting("", "RDMA device name(s).")
    global_segment_gib: float = setting(
        1.0, "Memory this process contributes to the store (0 for a pure consumer).", ge=0)
    local_buffer_gib: float = setting(0.5, "Registered staging memory.", gt=0)
    writer_threads: int = setting(2, "Puts in flight (they overlap the next forward).", ge=1)
    local_hostname: str = setting("127.0.0.1", "Address the other nodes reach this process at (its node's name or "
                                               "IP when the master, extractor and trainer run on different nodes).")
    put_timeout: float = setting(60.0, "How long a producer waits for space (back-pressure) before failing.",
                                 cli=False, gt=0)
    # Objects live in the memory their writers mount: a producer that mounted a segment
    # waits this long at exit for consumers to read what it published.
    linger_seconds: float = setting(
        600.0, "A producer that mounts memory waits this long at exit for consumers.", ge=0)


@dataclass
class LiveConfig:
    """How a live run (`--from mooncake`) gets the samples its cache lacks."""

    endpoint: str | None = setting(
        None, "Extraction server (vLLM + our connector, or `dspark serve`), e.g. http://host:8000/v1. "
              "Without it a live run waits for a producer (`dspark extract --to mooncake`).", flags=("--vllm-endpoint",))
    on_missing: Literal["generate", "skip", "warn", "raise"] = setting(
        "generate", "A sample not in the cache: fetch it live, or skip/warn/fail.")
    on_generate: Literal["keep", "delete"] = setting("keep", "delete: free it from Mooncake once cached.")
    request_timeout: float = setting(60.0, "Seconds per extraction request (a busy vLLM may take long).", gt=0)
    # A hung server (stopped, wedged) still accepts connections, so only a liveness check tells it from a slow one.
    stall_timeout: float = setting(
        10.0, "Seconds a hung extraction server may hold up live reads: a reply slower than half of it makes the "
              "server answer GET /health within the other half, else the live source is down at once.", gt=0)
    max_retries: int = setting(3, "Retries of a failed request.", ge=0)
    generation_validation_retries: int = setting(
        2, "Requests again when the returned tokens or values are wrong.", ge=0)
    max_consecutive_generation_failures: int = setting(
        8, "Failed requests in a row to a server that answers its liveness check, then training stops with a "
           "clear error (a server that does not answer is waited for: --max-down-seconds).", ge=1)
    # Time, not a count: a dead server fails in milliseconds, and a vLLM restart takes minutes.
    max_down_seconds: float = setting(
        600.0, "How long the extraction server may stay down (unreachable or hung) before the run stops; "
               "meanwhile training continues on cached samples, and the skipped ones are named in the run record.",
        gt=0)
    mooncake: MooncakeConfig = setting(factory=MooncakeConfig)


@dataclass(frozen=True)
class ServeLimits:
    """What one bad client of `dspark serve` may cost: a bounded wait, never a hung thread."""

    max_model_len: int | None = setting(
        None, "Longest prompt in tokens; longer ones get a 400. Default and most: the verifier's "
              "max_position_embeddings (positions past it were never trained).", ge=1)
    client_timeout: float = setting(30.0, "Seconds a connection has to send its request, then it gets a 408 and "
                                          "is closed; also bounds each reply write.", gt=0)
    max_connections: int = setting(64, "Connections served at once, one thread each (forwards run one at a time "
                                       "anyway); more get a 503 at once.", ge=1)

    def __post_init__(self):
        check_settings(self)


# --- dataclass <-> flat click parameters -------------------------------------------------------


def _leaves(cls, path: tuple[str, ...] = (), words: tuple[str, ...] = ()):
    """(path, flag, field, type) for every leaf setting, nested configs flattened.

    A nested config's flags carry its name (`--mooncake-master`) unless its field says
    `prefixed=False` (a run's live settings keep the seed's names: `--on-missing`).
    """
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        sub = hints[f.name]
        if is_dataclass(sub):
            yield from _leaves(sub, (*path, f.name), (*words, f.name) if f.metadata.get("prefixed", True) else words)
        else:
            flag = f.metadata.get("flags") or ("--" + "-".join((*words, f.name)).replace("_", "-"),)
            yield (*path, f.name), flag, f, sub


class IntList(click.Option):
    """An option taking one or more ints: `--target-layer-ids 1 3 5` (the seed's style) or `1,3,5`.

    Click options take a fixed count of values, so this one swallows the words
    that follow it up to the next option.
    """

    def add_to_parser(self, parser, ctx):
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            opt = parser._long_opt.get(name) or parser._short_opt.get(name)
            if opt:
                orig = opt.process

                def process(value, state, orig=orig):
                    values = [value]
                    while state.rargs and not state.rargs[0].startswith("-"):
                        values.append(state.rargs.pop(0))
                    orig(" ".join(values), state)

                opt.process = process

    def type_cast_value(self, ctx, value):
        if value is None:
            return None
        words = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
        try:
            return [int(x) for x in words]
        except (TypeError, ValueError):
            raise click.BadParameter(f"expected integers, got {value!r}") from None


def check_finite(flag: str, value, default=None, allow_inf: bool = False) -> None:
    """NaN passes every `<`/`>` bound (it compares false) and infinity passes lower ones, so each number
    setting refuses them by name, as one line: NaN always, infinity unless `allow_inf`."""
    if isinstance(value, float) and not (math.isfinite(value) or allow_inf and math.isinf(value)):
        kind = "a number" if allow_inf else "a finite number"
        raise InputError(f"{flag} {value} must be {kind}",
                         "pass a finite value" + ("" if default is None else f" (default {default})"))


class _Finite:
    """A click number type that refuses NaN and infinity before its own conversion and range checks.

    It raises our one-line InputError naming the option, as `check_settings` does, rather than click's
    usage block; the CLI's group catches it (parsing runs inside the group's invoke).
    """

    def __init__(self, *args, allow_inf: bool = False, **kw):
        super().__init__(*args, **kw)
        self.allow_inf = allow_inf

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float (e.g. 1e400 written out in a config file)
            number = math.inf
        except (TypeError, ValueError):  # not a number at all: the base type says so
            number = 0.0
        check_finite(param.opts[0] if param else "value", number, param.default if param else None, self.allow_inf)
        return super().convert(value, param, ctx)


class FiniteFloat(_Finite, click.types.FloatParamType):
    """A float option that is finite unless `allow_inf`."""


class FiniteFloatRange(_Finite, click.FloatRange):
    """A finite float option with click.FloatRange's bounds."""


class FiniteInt(_Finite, click.types.IntParamType):
    """An int option: `.inf` from a config file is refused in one line, not an OverflowError traceback."""


def _option(path, flags, f, hint) -> click.Option:
    meta = f.metadata
    name = SEP.join(path)
    default = None if f.default is MISSING else f.default
    kw: dict[str, Any] = {"help": meta.get("help", ""), "show_default": default not in (None, "")}
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if type(hint) is types.UnionType else hint
    if f.default is MISSING and f.default_factory is MISSING:
        kw["required"] = True
    if base is bool:
        if not meta.get("negatable", True):
            return click.Option([flags[0], name], is_flag=True, default=default, **kw)
        return click.Option([f"{flags[0]}/--no-{flags[0][2:]}", name], default=default, **kw)
    if typing.get_origin(base) is list:
        if typing.get_args(base) == (str,):  # a repeatable option: `--prompts a --prompts b`
            return click.Option([*flags, name], multiple=True, default=default, **kw)
        return IntList([*flags, name], default=default, **kw)
    if typing.get_origin(base) is Literal:
        return click.Option([*flags, name], type=click.Choice(typing.get_args(base)), default=default, **kw)
    if base is float:
        base = FiniteFloat(allow_inf=meta.get("allow_inf", False))
    elif base is int:
        base = FiniteInt()
    return click.Option([*flags, name], type=base, default=default, **kw)


def cli_leaves(cls, prefix: tuple[str, ...] = ()):
    """(path, flags, field, type) of each leaf setting that has a command-line option."""
    return [leaf for leaf in _leaves(cls, prefix, prefix) if leaf[2].metadata.get("cli", True)]


def options(cls, prefix: tuple[str, ...] = ()):
    """A decorator adding one click option per leaf setting of `cls` (in field order)."""
    opts = [_option(*leaf) for leaf in cli_leaves(cls, prefix)]

    def decorate(fn):
        fn.__click_params__ = getattr(fn, "__click_params__", []) + opts[::-1]
        return fn
    return decorate


def check_settings(cfg, prefix: tuple[str, ...] = ()) -> None:
    """Every setting's choices, finiteness and `ge`/`gt` bounds, as one line naming the flag and its value.

    Click checks finiteness on the command line and in config files; this also covers Python callers.
    """
    for path, flags, f, hint in _leaves(type(cfg), words=prefix):
        value = cfg
        for p in path:
            value = getattr(value, p)
        if typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            raise InputError(f"{flags[0]} {value!r} is not supported", f"use one of {list(typing.get_args(hint))}")
        default = None if f.default is MISSING else f.default
        check_finite(flags[0], value, default, f.metadata.get("allow_inf", False))
        ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
        if value is None or (ge is None and gt is None):
            continue
        if (ge is not None and value < ge) or (gt is not None and value <= gt):
            bound = f">= {ge}" if ge is not None else f"> {gt}"
            shown = "" if default is None else f" (default {default})"
            raise InputError(f"{flags[0]} {value} must be {bound}", f"pass a value {bound}{shown}")


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


def _unknown(key: str, where: str, cls) -> InputError:
    known = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    return InputError(f"unknown setting {key!r} in {where}",
                      f"did you mean {close[0]!r}?" if close else f"the settings here are {sorted(known)}")


def build(cls, data: dict[str, Any], where: str = "config"):
    """`cls` from a nested dict; an unknown key is an error naming it and the closest known one."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in sorted(set(data) - known):
        raise _unknown(key, where, cls)
    kw = {}
    for name, value in data.items():
        sub = hints[name]
        if is_dataclass(sub):
            if isinstance(value, sub):
                kw[name] = value
            elif isinstance(value, dict):
                kw[name] = build(sub, value, f"{where}.{name}")
            else:
                raise InputError(f"{where}.{name} must be a mapping of settings, got {value!r}",
                                 f"allowed keys: {sorted(f.name for f in fields(sub))}")
        else:
            kw[name] = value
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in kw]
    if missing:
        raise InputError(f"{where} lacks required setting(s) {missing}", "set them as flags or in the config file")
    return cls(**kw)


# --- --config FILE ----------------------------------------------------------------------------


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
    return yaml.load(text, Loader=loader)  # noqa: S506  (a safe loader)


def load_config_file(path: str | Path, cls) -> dict[str, Any]:
    """The click default_map for a YAML or JSON file of `cls` settings (nested like `to_dict`)."""
    path = Path(path)
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise InputError(f"config file {path} does not exist", "pass --config a YAML or JSON file") from None
    except FileRefused as e:  # a settings file is a few KB: a larger one would parse for minutes
        raise InputError(f"config file {path} {e}", "pass --config a YAML or JSON file of settings "
                                                    "(`dspark train --print-config` writes one)") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else _load_yaml(raw.decode(), path)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001  (any parse error is the same user mistake)
        mark = getattr(e, "problem_mark", None)  # YAML's position; JSON's message carries its own
        at = f" (line {mark.line + 1})" if mark else ""
        raise InputError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}{at}: "
                         f"{str(e).splitlines()[0]}", "fix the file (`dspark train --print-config` writes one)") from None
    if not isinstance(data, dict):
        raise InputError(f"config file {path} must hold a mapping of settings", "e.g. `lr: 0.001`")
    flat: dict[str, Any] = {}

    def walk(node: dict, sub, path_: tuple[str, ...]):
        hints = typing.get_type_hints(sub)
        known = {f.name: f for f in fields(sub)}
        for key, value in node.items():
            name = str(key).replace("-", "_")
            where = ".".join((*path_, name))
            if name not in known:
                raise _unknown(where, str(path), sub)
            if is_dataclass(hints[name]):
                if not isinstance(value, dict):
                    raise InputError(f"{where} in {path} must be a mapping", f"allowed keys: "
                                     f"{sorted(f.name for f in fields(hints[name]))}")
                walk(value, hints[name], (*path_, name))
            else:
                flat[SEP.join((*path_, name))] = value
    walk(data, cls, ())
    return flat


def config_file_option(cls):
    """`--config FILE`: its settings become the defaults; flags on the command line still win."""

    def load(ctx: click.Context, _param, value):
        if value:
            ctx.default_map = {**(ctx.default_map or {}), **load_config_file(value, cls)}
        return value

    return click.option("--config", "config_file", type=click.Path(dir_okay=False), is_eager=True,
                        expose_value=False, callback=load,
                        help="YAML or JSON file of settings (keys as in --print-config); flags override it.")
