"""One registry class for every plugin seam: sinks, sources, engines, generators, drafter kinds, trackers.

A registry maps a name to an entry (a factory, a class, a descriptor). Registering a name twice is a bug,
not an override. An entry may be declared lazily, as "module" (importing it registers the name) or
"module:attr" (the entry is that attribute): the registry knows its names without importing the
backends, so a settings check or the CLI's list of choices costs no torch, Zarr or vLLM import, and a
backend's module loads at its first lookup only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from dspark.core.errors import InputError

T = TypeVar("T")


def load(path: str):
    """"module:attr" -> that attribute, its module imported now: how every lazily named class or factory loads."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def parse_names(spec: str, known, flag: str) -> list[str]:
    """`zarr,mooncake` as its names, each one of `known`; else one line naming the unknown ones."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise InputError(f"unknown {flag} value(s) {unknown or spec!r}",
                         f"use one or more of {sorted(known)}, comma-separated")
    return names


class Registry(Generic[T]):
    """Name -> entry, for the flag `flag` (the one whose choices it lists)."""

    def __init__(self, what: str, flag: str, lazy: Mapping[str, str] | None = None):
        self.what, self.flag = what, flag
        self.entries: dict[str, T] = {}  # what is registered (loaded) so far
        self._lazy: dict[str, str] = dict(lazy or {})

    def register(self, name: str, entry: T | None = None):
        """`REG.register("x", entry)`, or `@REG.register("x")` over a class or function."""
        def add(value: T) -> T:
            if name in self.entries:
                raise ValueError(f"{self.what} {name!r} is registered twice ({self.entries[name]} and {value})")
            self.entries[name] = value
            return value
        return add if entry is None else add(entry)

    def names(self) -> list[str]:
        """Every name, in the order declared (a flag's --help lists its choices so); nothing is imported for it."""
        return list(dict.fromkeys([*self._lazy, *self.entries]))

    def __contains__(self, name: object) -> bool:
        return name in self.entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, name: str) -> T:
        """The entry, its module imported now; one line (InputError) for a name nothing registers."""
        if name not in self.entries and name in self._lazy:
            path = self._lazy[name]
            if ":" in path:
                self.register(name, load(path))
            else:
                importlib.import_module(path)
                if name not in self.entries:
                    raise ValueError(f"importing {path} registered no {self.what} {name!r}")
        if name not in self.entries:
            parse_names(str(name), self, self.flag)
        return self.entries[name]

    def items(self) -> list[tuple[str, T]]:
        """Every (name, entry), each backend imported."""
        return [(n, self[n]) for n in self.names()]

    def parse(self, spec: str) -> list[str]:
        """`a,b` as names this registry has; else one line naming the unknown ones and the choices."""
        return parse_names(spec, self, self.flag)

    def choices(self) -> tuple[str, ...]:
        return tuple(self.names())

