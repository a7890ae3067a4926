"""Training data: split, pack, collate and read ahead.

Samples come from a `Source` (the Zarr store, or the tiered Mooncake+cache
source) and their loss
masks from the prepared data. Packing and order are a pure function of (seed,
epoch), so a resumed run sees exactly the batches the uninterrupted one saw.

Every sample read is checked against its checksum (by the source). A damaged one
is never trained on: `on_damaged="skip"` drops it from its batch, warns once, and
names every skipped id at the end (`damaged_report`); `"raise"` stops the run.

Every sample a pass could not read (damaged, or a live source that was down) is
recorded by pass (`skipped`: "train epoch 0", "validation at epoch 0 batch 6") as the
trainer takes its batch; a replay, whose store holds what the live run fetched later,
leaves out the same ones (`reproduce`) and so trains on exactly what the run did.

A fixed store whose decoded samples all fit `keep_bytes` is kept in memory as it is
read: epochs after the first, and every validation, read and decode nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from dspark.connector.base import Sample, Source
from dspark.core.errors import DamagedSample, InputError, StoreError, StoreMismatch, repair_command
from dspark.data.prepare import PreparedData
from dspark.train.config import TrainConfig

log = logging.getLogger("dspark.data")
ON_DAMAGED = ("skip", "raise")


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def split_ids(samples: int, train_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids) of `samples` prepared samples: a run's split, also what `eval --decode`
    calibrates on (decode/cost.py), never a reported set."""
    perm = np.random.default_rng(seed).permutation(np.arange(samples, dtype=np.int64))
    n_train = int(round(train_ratio * samples))
    train, val = sorted(perm[:n_train].tolist()), sorted(perm[n_train:].tolist())
    for name, split in (("train", train), ("validation", val)):
        if not split:
            raise InputError(f"the {name} split is empty ({samples} samples, --train-data-ratio {train_ratio})",
                             "use more data or a --train-data-ratio that leaves samples on both sides")
    return train, val


class TrainData:
    def __init__(self, source: Source, prepared: PreparedData, total_seq_len: int, train_ratio: float, seed: int,
                 on_damaged: str, verifier: str | None = None, keep_bytes: int = 0,
                 layers: list[int] | None = None):
        """`layers`: the target layers batches hold, some of the store's (default: all of them)."""
        if on_damaged not in ON_DAMAGED:
            raise InputError(f"--on-damaged {on_damaged!r} is not a policy", f"use one of {', '.join(ON_DAMAGED)}")
        m = source.manifest
        m.require_match(source.location, f"pass the --data-path the store was extracted from ({prepared.path} is "
                                         "other prepared data)", prepared_fingerprint=prepared.fingerprint)
        if not source.live and len(source.sample_ids) < len(prepared):
            raise StoreError(f"store {source.location} holds {len(source.sample_ids)} of the "
                             f"{len(prepared)} prepared samples",
                             "finish the extraction first: rerun the same `dspark extract`, it resumes (or "
                             f"{repair_command(source.location, str(prepared.path), verifier)})")
        self.source, self.prepared = source, prepared
        self.on_damaged = on_damaged
        self.repair = repair_command(source.location, str(prepared.path), verifier)
        self.damaged: dict[int, str] = {}  # skipped sample id -> what is wrong with it
        self._damaged_lock = threading.Lock()
        self.skipped: dict[str, list[int]] = {}  # pass -> ids it trained without (the run records it)
        self.leave_out: dict[str, set[int]] = {}  # pass -> ids a replay leaves out unread (`reproduce`)
        self.total_seq_len, self.seed = total_seq_len, seed
        self.num_targets = len(m.target_layer_ids)  # the last layer's states follow the targets'
        self.layer_index = [m.target_layer_ids.index(i) for i in layers] if layers else list(range(self.num_targets))
        # Samples read so far, when all of them fit keep_bytes (a live source's are never kept: its
        # cache and counters must see every read). A sample is checked when first read, then kept as is.
        size = int(prepared.offsets[-1] - prepared.offsets[0]) * len(m.captured_layer_ids) * m.hidden_size \
            * _DTYPE_BYTES.get(m.dtype, 4)
        self.kept: dict[int, Sample] | None = {} if not source.live and size <= keep_bytes else None
        self.train_ids, self.val_ids = split_ids(len(prepared), train_ratio, seed)

    def read(self, sample_id: int) -> Sample | None:
        """The sample, or None when it cannot be had (live) or is damaged and skipped."""
        kept = self.kept
        if kept is not None and sample_id in kept:
            return kept[sample_id]
        try:
            sample = self.source.read(sample_id)
            if kept is not None and sample is not None:
                kept[sample_id] = sample
            return sample
        except DamagedSample as e:
            if self.on_damaged == "raise":
                raise StoreError(f"{e.what}; --on-damaged raise stops here",
                                 f"re-extract it: {self.repair}, or train around it with --on-damaged skip") from None
            with self._damaged_lock:
                first = not self.damaged
                self.damaged.setdefault(sample_id, e.reason)
            if first:
                log.warning("%s: skipped (--on-damaged skip); every skipped sample is named at the end", e.what)
            return None

    def reproduce(self, skipped: dict[str, list[int]]) -> None:
        """Leave out, unread, what a recorded run skipped (its `skipped`), pass by pass."""
        self.leave_out = {where: set(ids) for where, ids in skipped.items()}

    def holds(self, ids: list[int]) -> bool:
        """Whether these samples are in memory (reading them costs nothing)."""
        return self.kept is not None and all(i in self.kept for i in ids)

    def read_all(self, num_workers: int) -> None:
        """Read every sample into memory now, if they fit, so that no read runs beside a training step.

        On a few cores a reader beside the step costs far more than its own time: the step's
        OpenMP team stalls at every parallel region while a reader holds one of its cores.
        """
        if self.kept is None:
            return
        todo = [i for i in (*self.train_ids, *self.val_ids) if i not in self.kept]
        with ThreadPoolExecutor(max(1, num_workers), initializer=_one_torch_thread) as pool:
            for _ in pool.map(self.read, todo):
                pass

    def damaged_report(self) -> str | None:
        """One line naming every damaged sample skipped so far, with the repair command; None if none."""
        if not self.damaged:
            return None
        ids = sorted(self.damaged)
        shown = ", ".join(map(str, ids[:20])) + (", ..." if len(ids) > 20 else "")
        return (f"{len(ids)} damaged sample{'s' * (len(ids) != 1)} skipped (ids {shown}) in "
                f"{self.source.location}; repair with {self.repair}")

    def pack(self, ids: list[int]) -> list[list[int]]:
        """Greedy sequential packing into bins of total_seq_len tokens."""
        bins, cur, used = [], [], 0
        for i in ids:
            n = min(self.prepared.length(i), self.total_seq_len)
            if cur and used + n > self.total_seq_len:
                bins.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += n
        if cur:
            bins.append(cur)
        return bins

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.train_ids).tolist()
        return self.pack(order)

    def val_batches(self) -> list[list[int]]:
        return self.pack(self.val_ids)

    def collate(self, samples: list[Sample | None]) -> dict[str, torch.Tensor] | None:
        """Pack samples into speculators' batch layout (every tensor with a leading 1).

        A live source returns None for a sample it could not get; the batch trains
        without it, and a batch left empty is skipped.
        """
        samples = [s for s in samples if s is not None]
        if not samples:
            return None
        L, T = self.num_targets, self.total_seq_len
        ids, masks, hidden, docs, pos = [], [], [], [], []
        for d, s in enumerate(samples):
            tok, mask = self.prepared.sample(s.sample_id)
            n = min(len(tok), T)
            if not np.array_equal(s.token_ids[:n], tok[:n]):
                raise StoreMismatch(f"sample {s.sample_id}: the store's token ids differ from the prepared data",
                                    "the store was made from other data; re-extract it")
            ids.append(torch.from_numpy(tok[:n]))
            masks.append(torch.from_numpy(mask[:n].astype(np.int64)))
            hidden.append(s.hidden_states[:n])
            docs.append(torch.full((n,), d, dtype=torch.long))
            pos.append(torch.arange(n))
        h = torch.cat(hidden)  # [S, L+1, H]
        return {
            "hidden_states": h[:, self.layer_index].reshape(1, h.shape[0], -1),
            "verifier_last_hidden_states": h[:, L].unsqueeze(0),
            "input_ids": torch.cat(ids).unsqueeze(0),
            "loss_mask": torch.cat(masks).unsqueeze(0),
            "document_ids": torch.cat(docs).unsqueeze(0),
            "position_ids": torch.cat(pos).unsqueeze(0),
        }


class Loader:
    """Iterates collated batches, reading `prefetch` batches ahead on `num_workers` background threads (by default
    as many as training's defaults: `--num-workers`, `--prefetch-factor`).

    Batches whose samples are all in memory are collated in the caller's thread instead.

    A batch left empty (every sample skipped) is dropped, or yielded as None with
    `keep_empty` (the training loop counts it to keep its data position exact).
    `wait_seconds` counts the time the training loop spent blocked on data.
    A batch that came back empty is read once more if its source says waiting helped
    (`Source.wait_for_recovery`: a live source that was down); a source held in memory never does.
    With `where` (the pass, e.g. "train epoch 0"), the samples skipped from each batch are
    recorded in `data.skipped` when the caller takes the batch (not when read ahead, so a
    checkpoint records exactly the batches trained), and that pass's `data.leave_out` are
    left out unread. A read that fails (a live source that gave up) stops the pass: the reads in
    flight finish, those queued behind it are dropped.
    """

    READ_AHEAD_BATCHES = 2  # batches whose sample reads are in flight beside the one being collated

    def __init__(self, data: TrainData, batches: list[list[int]], num_workers: int = TrainConfig.num_workers,
                 prefetch: int = TrainConfig.prefetch_factor, keep_empty: bool = False, where: str | None = None):
        self.data, self.batches = data, batches
        self.num_workers, self.prefetch = max(1, num_workers), max(1, prefetch)
        self.keep_empty = keep_empty
        self.where = where
        self._leave_out = data.leave_out.get(where, set()) if where else set()
        self.wait_seconds = 0.0

    def __len__(self) -> int:
        return len(self.batches)

    def _read(self, sample_id: int) -> Sample | None:
        return None if sample_id in self._leave_out else self.data.read(sample_id)

    def _collate(self, batch: list[int], samples: list[Sample | None]) -> tuple[dict | None, list[int]]:
        """(the collated batch or None, the ids skipped from it)."""
        return self.data.collate(samples), [i for i, s in zip(batch, samples) if s is None]

    def _taken(self, item: dict | None, skipped: list[int]) -> bool:
        """The caller takes this batch: record its skipped ids; whether to yield it."""
        if skipped and self.where:
            self.data.skipped.setdefault(self.where, []).extend(skipped)
        return item is not None or self.keep_empty

    def _in_memory(self):
        for b in self.batches:
            start = time.perf_counter()
            item, skipped = self._collate(b, [self._read(i) for i in b])
            self.wait_seconds += time.perf_counter() - start
            if self._taken(item, skipped):
                yield item

    def __iter__(self):
        if self.data.holds([i for b in self.batches for i in b]):
            yield from self._in_memory()  # collating costs less than a thread fighting the step for a core
            return
        q: queue.Queue = queue.Queue(self.prefetch)
        stop = threading.Event()

        def put(item) -> bool:
            """Queue item unless the consumer has stopped: a bare put on a full queue would block this thread,
            and the consumer's join with it, forever (an exception in the training step near a pass's end)."""
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            _one_torch_thread()
            pool = ThreadPoolExecutor(self.num_workers, initializer=_one_torch_thread)  # threads start lazily
            try:
                # The reads of the next batches stay in flight while this one is collated and queued:
                # reading batch by batch left the readers idle through every collate.
                ahead: deque[tuple[list[int], list[Future]]] = deque()
                batches = iter(self.batches)

                def read_ahead():
                    while len(ahead) < self.READ_AHEAD_BATCHES and (b := next(batches, None)) is not None:
                        ahead.append((b, [pool.submit(self._read, i) for i in b]))

                read_ahead()
                while ahead:
                    b, reads = ahead.popleft()
                    read_ahead()
                    item = self._collate(b, [f.result() for f in reads])  # (batch or None, skipped ids)
                    if item[0] is None and set(b) - self._leave_out and self.data.source.wait_for_recovery(stop):
                        item = self._collate(b, list(pool.map(self._read, b)))  # the source is back: once more
                    if not put(item):
                        return
            except BaseException as e:  # hand the failure to the consumer, which re-raises it
                put(e)
                return
            finally:
                # The reads in flight finish (none outlives the loop); those queued are dropped: after a failure
                # (a live source that gave up) the run stops now, not after each queued read waited out its
                # request timeout and retries.
                pool.shutdown(wait=True, cancel_futures=True)
            put(None)

        t = threading.Thread(target=produce, daemon=True, name="dspark-loader")
        t.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self.wait_seconds += time.perf_counter() - t0
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if self._taken(*item):
                    yield item[0]
        finally:
            stop.set()
            t.join()  # no reads (or live write-throughs) may outlive the loop that asked for them


def _one_torch_thread() -> None:
    """Torch ops on this reader thread (collate's cat, a source's decode) run on it alone.

    Torch's intra-op thread count is per calling thread: left at the core count, each reader
    would bring its own OpenMP team to fight the training step's for the same cores.
    """
    torch.set_num_threads(1)

