"""Click options made from typed settings: each option is one leaf of a config (`dspark.core.settings`).

`options(cls)` adds one option per leaf setting, its default, type, choices and bounds taken from the
field; `config_file_option(cls)` reads `--config FILE` into the same options' defaults. Every generated
parameter carries its `Leaf` (`param.setting`), so a test can prove no option is written by hand.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING
from typing import Any, Literal

import click

from dspark.core.errors import InputError
from dspark.core.settings import Leaf, base_type, check_finite, checked, cli_leaves, load_config_file


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
        flag = param.opts[0] if param else "value"
        check_finite(flag, number, param.default if param else None, self.allow_inf)
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:  # one `error:` line, as every other bad setting, not click's usage block
            expected = "an integer" if isinstance(self, click.types.IntParamType) else "a number"
            raise InputError(f"{flag} {value!r} is not {expected}", f"pass {expected}" + (
                "" if param is None or param.default is None else f" (default {param.default})")) from None


class FiniteFloat(_Finite, click.types.FloatParamType):
    """A float option that is finite unless `allow_inf`."""


class FiniteInt(_Finite, click.types.IntParamType):
    """An int option: `.inf` from a config file is refused in one line, not an OverflowError traceback."""


class IntOrWord(FiniteInt):
    """An int option that also takes the words of a `Literal` arm of its type (`--num-speculative-tokens auto`)."""

    def __init__(self, words: tuple[str, ...]):
        super().__init__()
        self.words = words
        self.name = "|".join(("integer", *words))

    def convert(self, value, param, ctx):
        return value if value in self.words else super().convert(value, param, ctx)


def _words(hint) -> tuple[str, ...]:
    """The words a union type takes beside its number: its `Literal` arms' values."""
    return tuple(w for arm in typing.get_args(hint) if typing.get_origin(arm) is Literal for w in typing.get_args(arm))


def _param(leaf: Leaf) -> click.Parameter:
    path, flags, f, hint, default, _ = leaf
    meta = f.metadata
    name = "__".join(path)
    required = default is MISSING
    default = None if required else default
    kw: dict[str, Any] = {"help": meta.get("help", ""), "show_default": default not in (None, "", [], ()),
                          "required": required}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    base = base_type(hint)
    if base is float:
        kw["type"] = FiniteFloat(allow_inf=meta.get("allow_inf", False))
    elif base is int:
        kw["type"] = IntOrWord(_words(hint)) if _words(hint) else FiniteInt()
    elif typing.get_origin(base) is Literal:
        kw["type"] = click.Choice(typing.get_args(base))
    elif base is str:
        kw["type"] = str
    if meta.get("positional"):
        kw.pop("help"), kw.pop("show_default")
        return click.Argument([name], default=default, **kw)
    if meta.get("switch") is not None:  # `--fp8` sets `encoding: fp8_e4m3`; its absence keeps the default
        kw.pop("type", None)
        kw["show_default"] = False
        return click.Option([flags[0], name], flag_value=meta["switch"], default=default, **kw)
    if base is bool:
        if not meta.get("negatable", True):
            return click.Option([flags[0], name], is_flag=True, default=default, **kw)
        return click.Option([f"{flags[0]}/--no-{flags[0][2:]}", name], default=default, **kw)
    if typing.get_origin(base) is list:
        if typing.get_args(base) == (str,):  # a repeatable option: `--prompts a --prompts b`
            return click.Option([*flags, name], multiple=True, default=default, **kw)
        kw.pop("type", None)
        return IntList([*flags, name], default=default, **kw)
    return click.Option([*flags, name], default=default, **kw)


def params(cls) -> list[click.Parameter]:
    """One click parameter per leaf setting of `cls` that has one, each carrying its leaf."""
    made = []
    for leaf in cli_leaves(cls):
        param = _param(leaf)
        param.setting = leaf
        made.append(param)
    return made


def options(*classes):
    """A decorator adding the parameters of each class's settings (in field order)."""
    made = [p for cls in classes for p in params(cls)]

    def decorate(fn):
        fn.__click_params__ = getattr(fn, "__click_params__", []) + made[::-1]
        return fn
    return decorate


def config_file_option(cls, section: str | None = None):
    """`--config FILE`: its settings (section `section` of a deployment file) become the defaults; flags on
    the command line still win."""

    def load(ctx: click.Context, _param, value):
        if value:
            from dspark.deployment import SECTIONS  # the commands' configs: imported only when a file is given
            ctx.default_map = {**(ctx.default_map or {}), **load_config_file(value, cls, section, SECTIONS)}
        return value

    return click.option("--config", "config_file", type=click.Path(dir_okay=False), is_eager=True,
                        expose_value=False, callback=load,
                        help="YAML or JSON file of settings (keys as in --print-config); flags override it.")


def configs(kw: dict, *classes) -> list:
    """Each class's config from a command's parameters: each takes the names of its own settings."""
    made = []
    for cls in classes:
        names = {"__".join(leaf.path) for leaf in cli_leaves(cls)}
        made.append(checked(cls, {k: v for k, v in kw.items() if k in names}))
    return made
