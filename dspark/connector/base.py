"""The connector's seams: one sample type, the `Sink` and `Source` interfaces (registry.py finds them by name).

Producers (the transformers engine, `dspark serve`, the vLLM KV connector) hand
each finished sample to a sink; the trainer and eval read samples back through a
source. Both are found by name, so `--to zarr,mooncake` or `--from mooncake` is a
registry lookup, never a branch on a concrete type. A new backend is a new file.

Sink lifecycle (one writer session; write and flush may be called from several threads)
    construct      opens or creates the destination; checks it holds this store identity
    has(id)        is the sample already durable here? (resume skips it)
    write(sample)  hands a sample over (an offline sink ignores one it already holds; a live
                   sink replaces it: a regenerated sample must win). It returns at once or
                   after the write, as the sink likes; the returned future resolves once the
                   sample is *durable* (readers can see it, a crash keeps it) to its transfer
                   params (a live sink) or None (an offline one), or raises what went wrong.
    write_error    publishes "this sample failed" under its handle where readers wait (live
                   sinks), so they fail at once instead of timing out; a no-op elsewhere.
    flush()        every sample written so far is durable and visible; raises a failed write.
    close()        flush, then release everything; called exactly once, also after errors.

Source lifecycle (shared by the loader's reader threads)
    manifest, sample_ids, fingerprint()   what the source holds and its content identity
    location       where the samples live (a path or address), for messages
    read(id)       thread-safe; the sample, its checksum verified, or None when a live source
                   could not get it (the batch trains without it). Offline sources raise for an
                   absent sample, and `DamagedSample` for one they hold but cannot give back
                   intact (the trainer's --on-damaged decides what happens then).
    live           False: every prepared sample must be present before training starts.
                   True: samples arrive as they are read (fetched, then cached).
    stats          counters worth logging ({} when there are none).
    wait_for_recovery(stop)   called by a reader thread when a batch came back with no sample:
                   blocks while the source cannot serve its misses yet (a live source that is
                   down; past its own budget it raises) or until `stop` is set; True when reading
                   the batch again may give samples. Default: False at once (waiting cannot help).
    close()        releases what the source holds; called exactly once.

A store at rest (an offline source, opened by `open_store`) also answers, for resume, repair and
`dspark store`; a live source holds nothing at rest, and the defaults say so (nothing missing or damaged):
    missing(ids)   the ids of `ids` it does not hold
    damaged(id)    None if that sample reads back intact, else what is wrong (reads it whole)
    verify(...)    a VerifyReport: every sample read back (thorough) or the cheap check a resume can
                   afford (nothing decoded), damaged index entries, and the expected ids it lacks
    check(...)     `dspark store verify`: verify, say each problem, raise naming the repair, or the ok line
    repaired(r)    every sample report `r` found damaged or missing is stored again (`store repair`)
    info()         what `dspark store info` prints
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dspark.connector.manifest import StoreManifest
from dspark.connector.registry import SINKS, SOURCES, store_backend
from dspark.core.errors import StoreError, repair_command

if TYPE_CHECKING:  # in annotations only: opening a store (`store info`, a refused path) loads no torch
    import torch


@dataclass
class Sample:
    """One sample's hidden states: `hidden_states [T, L+1, H]` (targets, then last layer pre-norm).

    `handle` names the live object (default: derived from the store identity and the
    sample id; requests that carry no sample id get one of their own).
    """

    sample_id: int
    token_ids: np.ndarray  # int64 [T]
    hidden_states: torch.Tensor  # [T, L+1, H], the verifier dtype
    handle: str | None = None

    def __post_init__(self):
        if self.hidden_states.shape[0] != len(self.token_ids):
            raise ValueError(f"sample {self.sample_id}: {len(self.token_ids)} tokens but "
                             f"{self.hidden_states.shape[0]} hidden-state rows")


def done(value=None) -> Future:
    """A future that has already resolved: what a write that had nothing to do returns."""
    f: Future = Future()
    f.set_result(value)
    return f


class Sink(ABC):
    name: str
    manifest: StoreManifest
    bytes_written: int = 0

    @abstractmethod
    def has(self, sample_id: int) -> bool: ...

    @abstractmethod
    def write(self, sample: Sample) -> Future: ...

    def write_error(self, handle: str, error: str) -> None:
        """Nobody waits on an offline sink: nothing to publish."""

    @abstractmethod
    def flush(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class TeeSink(Sink):
    """Several sinks as one: a sample is durable once it is durable in every one of them."""

    name = "tee"

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.manifest = sinks[0].manifest

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self.sinks)

    def has(self, sample_id: int) -> bool:
        return all(s.has(sample_id) for s in self.sinks)

    def write(self, sample: Sample) -> Future:
        parts = [s.write(sample) for s in self.sinks]
        out: Future = Future()
        left = [len(parts)]

        def one_done(_):
            left[0] -= 1
            if left[0] == 0:  # resolves to the transfer params of the sink that has any (the live one)
                errors = [p.exception() for p in parts if p.exception()]
                if errors:
                    out.set_exception(errors[0])
                else:
                    out.set_result(next((p.result() for p in parts if p.result()), None))

        for p in parts:
            p.add_done_callback(one_done)
        return out

    def write_error(self, handle: str, error: str) -> None:
        for s in self.sinks:
            s.write_error(handle, error)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        close_all(self.sinks)


def close_all(sinks: list[Sink]) -> None:
    """Close every sink, even after one failed; then raise the first failure."""
    errors = []
    for s in sinks:
        try:
            s.close()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


@dataclass
class VerifyReport:
    """What verifying a store found; `problems` is empty for a store that holds everything intact."""

    samples: int = 0  # sample ids the store holds
    damaged: dict[int, str] = field(default_factory=dict)  # id -> what is wrong, of samples no copy of which reads back
    damaged_records: list[tuple] = field(default_factory=list)  # damaged index entries not repaired: each may hide one
    repaired_records: int = 0  # damaged index entries a `dspark store repair` made good
    missing: list[int] | None = None  # expected ids the store lacks; None: not compared (no prepared data given)
    expected: int | None = None  # how many samples it should hold, when known

    @property
    def problems(self) -> list[str]:
        out = []
        if self.damaged:
            out.append(f"{len(self.damaged)} of {self.samples} samples are damaged (first: {sorted(self.damaged)[:5]})")
        if self.missing:
            out.append(f"{len(self.missing)} prepared samples are missing (first: {self.missing[:5]})")
        if self.damaged_records and self.missing is None:
            out.append(f"{len(self.damaged_records)} damaged index records: the samples they held may be missing")
        return out

    def lines(self, most: int = 20) -> list[str]:
        """One line per problem found (up to `most` of each kind), as `dspark store verify` says them."""
        out = [f"sample {i}: {self.damaged[i]}" for i in sorted(self.damaged)[:most]]
        out += [self.record_line(r) for r in self.damaged_records[:most]]
        if self.missing:
            out.append(f"missing: {len(self.missing)} of {self.expected} prepared samples, first {self.missing[:most]}")
        return out

    def record_line(self, record: tuple) -> str:
        """A damaged index entry, as its backend names it."""
        return f"index entry {record} is damaged"


class Source(ABC):
    manifest: StoreManifest
    location: str
    live: bool = False

    @property
    @abstractmethod
    def sample_ids(self) -> list[int]: ...

    @abstractmethod
    def read(self, sample_id: int) -> Sample | None: ...

    @abstractmethod
    def fingerprint(self) -> str: ...

    @property
    def stats(self) -> dict:
        return {}

    def wait_for_recovery(self, stop: threading.Event) -> bool:
        """Nothing to wait for by default: a sample it could not give now it cannot give later."""
        return False

    def close(self) -> None:
        """Nothing held by default."""

    # --- a store at rest (the defaults: a live source, which keeps nothing it could lack or damage) ---
    def missing(self, ids: Iterable[int]) -> list[int]:
        """The ids of `ids` it does not hold, in their order."""
        return []

    def damaged(self, sample_id: int) -> str | None:
        """None if the sample reads back intact, else what is wrong."""
        return None

    def verify(self, ids: Iterable[int] | None = None, expected: int | None = None, *, thorough: bool = True,
               workers: int = 4, progress: bool = False) -> VerifyReport:
        """Every sample held (or `ids`) read back against its checksum, or with `thorough=False` only what a
        resume can afford (nothing decoded); damaged index entries; given `expected` (the prepared data's
        count), the ids in range(expected) it lacks."""
        return VerifyReport(missing=None if expected is None else [], expected=expected)

    def check(self, expected: int | None = None, prepared_fingerprint: str | None = None, data: str | None = None,
              progress: bool = False, say: Callable[[str], None] = print) -> str:
        """`dspark store verify`: the store must hold `prepared_fingerprint`'s samples (when given); every
        problem `verify` finds is said (`say`), then a StoreError naming the repair; else the ok line."""
        where = self.location
        if prepared_fingerprint is not None:
            self.manifest.require_match(where, f"pass --data the prepared folder the store was extracted from ({data} "
                                        "is other prepared data)", prepared_fingerprint=prepared_fingerprint)
        found = self.verify(expected=expected, progress=progress)
        for line in found.lines():
            say(line)
        if found.problems:
            raise StoreError(f"store {where}: " + "; ".join(found.problems),
                             f"{repair_command(where, data)} re-extracts exactly these samples"
                             + ("" if expected is not None else " (and `store verify --data` names the missing ones)"))
        if expected is None:
            return (f"ok: {found.samples} samples verified in {where} (not compared with the prepared data: pass "
                    "--data to find missing samples)")
        return f"ok: {found.samples} samples verified in {where}, all {expected} prepared samples present"

    def repaired(self, found: VerifyReport) -> None:
        """Every sample `found` named damaged or missing is stored again: the damage it found hides nothing now."""

    def info(self) -> dict:
        """What `dspark store info` prints."""
        return {"store": self.location, "samples": len(self.sample_ids)}


class PromptSet(Protocol):
    """What a live source needs of prepared data (prepare's `PreparedData` is one)."""

    fingerprint: str

    def __len__(self) -> int: ...

    def token_ids(self, sample_id: int) -> np.ndarray: ...


def open_sink(spec: str, **options) -> Sink:
    """`zarr`, `mooncake` or `zarr,mooncake` (a tee); options go to every factory, each takes its own."""
    sinks: list[Sink] = []
    try:
        for name in SINKS.parse(spec):
            sinks.append(SINKS[name](**options))
    except BaseException:
        close_all(sinks)
        raise
    return sinks[0] if len(sinks) == 1 else TeeSink(sinks)


def open_store(path: str | Path, via: str | None = None) -> Source:
    """The store at rest in folder `path`, opened for reading: the one backend `via` (a --from or --to name)
    keeps its samples in (its own store, or a live source's cache); without `via`, the offline backend's."""
    return SOURCES[store_backend(via).name](store=path)
