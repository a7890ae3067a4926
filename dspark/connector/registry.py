"""Registry (name -> factory, each backend loaded at its first lookup), and the sink and source registries.

Torch-free and free of the backends themselves: settings validate names against the module tables here
without importing Zarr, Mooncake or torch. The engines' registry is extract/base.py's ENGINES.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.errors import InputError


def parse_names(spec: str, known, flag: str) -> list[str]:
    """`zarr,mooncake` as its names, each one of `known`; else one line naming the unknown ones."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise InputError(f"unknown {flag} value(s) {unknown or spec!r}",
                         f"use one or more of {sorted(known)}, comma-separated")
    return names


# The backends by name, and the module registering each (its registry imports it at its first lookup).
SINK_MODULES = {"zarr": "dspark.connector.zarr.writer", "mooncake": "dspark.connector.mooncake.sink"}
SOURCE_MODULES = {"zarr": "dspark.connector.zarr.reader", "mooncake": "dspark.connector.live"}


class Registry(dict):
    """Name -> factory; registering a name twice is a bug, not an override.

    The backends register themselves when their module is imported, and a registry imports
    them (`backends`: name -> module) at its first lookup, not before: reading a config or
    loading our connector into vLLM does not pay for every backend's imports.
    """

    def __init__(self, kind: str, flag: str, backends: dict[str, str] | None = None):
        super().__init__()
        self.kind, self.flag, self._backends = kind, flag, dict(backends or {})

    def _load(self) -> None:
        import importlib

        while self._backends:
            importlib.import_module(self._backends.popitem()[1])

    def register(self, name: str):
        def deco(factory: Callable):
            if dict.__contains__(self, name):
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self[name]} and {factory})")
            self[name] = factory
            return factory
        return deco

    def __getitem__(self, name: str):
        self._load()
        return super().__getitem__(name)

    def __contains__(self, name) -> bool:
        self._load()
        return super().__contains__(name)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def parse(self, spec: str) -> list[str]:
        return parse_names(spec, self, self.flag)


SINKS = Registry("sink", "--to", SINK_MODULES)
SOURCES = Registry("source", "--from", SOURCE_MODULES)
register_sink, register_source = SINKS.register, SOURCES.register
