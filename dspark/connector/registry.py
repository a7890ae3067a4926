"""The backends by name (BACKENDS), and the sink and source registries made from them (dspark.core.registry's one class).

A backend is one descriptor here: its name, its settings class (SinkConfig holds one under the backend's
name), the factories opening its sink and its source, and whether it keeps samples at rest. Every path
is imported at its first use, so this module is torch-free and free of the backends themselves: settings
validate `--to`/`--from` against these without importing Zarr, Mooncake or torch. A new backend is a
folder with its config, sink and source, plus its one line in `_BACKENDS`.

Callers never compare a backend's name: they ask its descriptor (`live`, `offline`, `at_rest`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.core.registry import Registry, load


@dataclass(frozen=True)
class Backend:
    """What dspark knows of a backend before importing it.

    An offline backend's config has `store` (the folder), `accept_other_weights` and `existing_manifest()`;
    its source answers `missing`, `damaged`, `verify` and `repaired` (base.py's Source says what each does).
    """

    name: str
    config: str  # "module:Class": its settings, torch-free (the command line builds its options from them)
    sink: str  # "module:function" opening its sink: (manifest=..., <name>=its config, ...); each takes its own
    source: str  # "module:function" opening its source: (store=..., manifest=..., prompts=..., live=...)
    offline: bool  # samples at rest in a folder, all there before a run starts: resumed, verified, repaired, replayed
    at_rest: str  # the offline backend whose store holds what its source read: itself, or a live source's cache

    @property
    def live(self) -> bool:
        """Samples arrive as they are read (a live source fetches what it lacks, then caches it)."""
        return not self.offline

    @property
    def config_class(self) -> type:
        return load(self.config)


_BACKENDS = (
    Backend("zarr", "dspark.connector.config:ZarrConfig", "dspark.connector.zarr.writer:open_sink",
            "dspark.connector.zarr.reader:open_source", offline=True, at_rest="zarr"),
    Backend("mooncake", "dspark.connector.config:MooncakeConfig", "dspark.connector.mooncake.sink:open_sink",
            "dspark.connector.live:open_source", offline=False, at_rest="zarr"),  # its source caches into a store
)
BACKENDS: Registry[Backend] = Registry("backend", "--to/--from")
for _b in _BACKENDS:
    BACKENDS.register(_b.name, _b)
SINKS = Registry("sink", "--to", {b.name: b.sink for b in _BACKENDS})
SOURCES = Registry("source", "--from", {b.name: b.source for b in _BACKENDS})


def is_live(name: str | None) -> bool:
    """Whether `name` (a recorded --from, possibly absent or of a backend no longer here) is a live backend."""
    return isinstance(name, str) and name in BACKENDS and BACKENDS[name].live


def store_backend(via: str | None = None) -> Backend:
    """The offline backend whose store holds what backend `via` kept (itself, or a live source's cache);
    without `via`, the one offline backend (a `dspark store` command is given a folder only)."""
    if via is not None:
        return BACKENDS[BACKENDS[via].at_rest]
    (offline,) = [b for _, b in BACKENDS.items() if b.offline]  # a second one would need telling apart here
    return offline
