"""The training loop: short and readable, CPU or CUDA, single process or torchrun.

One step: read-ahead loader -> packed batch -> DSparkDraftModel forward (loss and
metrics from speculators) -> backward -> clip -> optimizer(s) -> schedule.
Every `log_freq` steps the window's metrics go to metrics.jsonl; every
`checkpoint_freq` of an epoch we validate and checkpoint everything a resume
needs to continue bit for bit: weights, optimizer, schedule, RNG, data position,
and the metric sums of the log window in progress. Stopping at --max-steps
checkpoints too (without validating), so a rerun continues from exactly there.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from importlib.metadata import version

import numpy as np
import torch

from dspark.connector.base import Source
from dspark.connector.config import SinkConfig
from dspark.connector.registry import BACKENDS, SOURCES
from dspark.connector.manifest import default_store, manifest_for_model
from dspark.core.errors import InputError, StoreError, StoreMismatch, TrainingDiverged
from dspark.kinds import KINDS
from dspark.data.prepare import PreparedData
from dspark.tracking.run import Tracking, flatten, require_installed
from dspark.train.blocks import score_with_controls, state_gain, sums, with_donors
from dspark.train.device import input_dtype, pick_device, to_device
from dspark.train.checkpoint import RunDir, load_trainer_state, load_weights, rng_state, set_rng_state
from dspark.train.config import TrainConfig
from dspark.train.data import Loader, TrainData
from dspark.train.metrics import MetricLog, accumulate, all_reduce, reduce
from dspark.train.model import build_model, build_optimizers, build_schedulers, loss_kwargs, model_inputs
from dspark.verifier.resolved import Verifier


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_kind: str) -> Dist:
    """The process group of a torchrun launch, as speculators' trainer starts it: on CUDA this rank's GPU is set
    first and named to NCCL (`device_id`), which binds its communicator to that GPU at once instead of guessing
    one at the first collective (where every rank may pick GPU 0)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def open_source(cfg: TrainConfig, prepared: PreparedData, verifier: Verifier) -> Source:
    """The training data source named by --from: a Zarr store, or the live tiered source."""
    SOURCES.parse(cfg.source)
    # a live source fetches samples of this identity (as a server's sinks store them); a store at rest reads its own
    manifest = manifest_for_model(verifier, cfg.target_layer_ids, prepared.fingerprint,
                                  encoding=SinkConfig().encoding) if BACKENDS[cfg.source].live else None
    return SOURCES[cfg.source](store=cfg.store, manifest=manifest, prompts=prepared, live=cfg.live)


def require_matching_store(source, cfg: TrainConfig, verifier: Verifier) -> None:
    """The store must hold this verifier's states, at least at the layers this drafter reads."""
    m = source.manifest
    if not set(cfg.target_layer_ids) <= set(m.target_layer_ids):  # a drafter may read some of the store's layers
        raise StoreMismatch(f"store {cfg.store} does not match verifier {cfg.verifier_name_or_path}: layer ids: store "
                            f"{m.target_layer_ids}, --target-layer-ids {list(cfg.target_layer_ids)} (the store must "
                            "hold each of them)", "train with the layer ids the store was extracted with")
    if m.require_match(cfg.store, "train with the verifier the store was extracted with", verifier=verifier,
                       accept_other_weights=cfg.accept_other_weights, hidden_size=verifier.info.hidden_size,
                       tokenizer_hash=verifier.tokenizer_hash):
        print(f"warning: store {cfg.store} was extracted with other verifier weights than {verifier}; "
              "training on it anyway (--accept-other-weights, recorded in the run's config)", file=sys.stderr)


def versions() -> dict:
    pkgs = ("dspark", "torch", "speculators", "transformers", "zarr", "numpy")
    return {**{p: version(p) for p in pkgs}, "python": platform.python_version()}


class Trainer:
    def __init__(self, cfg: TrainConfig, force: bool = False, progress: bool = True):
        self.cfg = cfg.validate()
        self.dist = setup_distributed("cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        self.run = RunDir(cfg.save_path)
        # One writer per run folder, taken before anything loads and held to the end of fit(): a second
        # train on it is refused at once, naming this one.
        self.lock = self.run.lock() if self.dist.main else None
        try:
            self._setup(cfg, force, progress)
        except BaseException:
            self.unlock()
            raise

    def _setup(self, cfg: TrainConfig, force: bool, progress: bool) -> None:
        self.tracking = None
        if self.dist.main:  # a tracker named but not installed: one line now, not after loading everything
            require_installed(cfg.tracking.trackers())
        self.device = pick_device(cfg.device, self.dist.local_rank)
        self.progress = progress and self.dist.main
        seed_everything(cfg.seed)
        self.prepared = PreparedData(cfg.data_path)
        self.verifier = Verifier.resolve(cfg.verifier_name_or_path, trust_remote_code=cfg.trust_remote_code)
        if cfg.store is None:  # resolved here, so the run's record names the folder it used
            cfg.store = default_store(self.verifier.folder, cfg.target_layer_ids, self.prepared.fingerprint)
        self.source = open_source(cfg, self.prepared, self.verifier)
        require_matching_store(self.source, cfg, self.verifier)
        self.data = TrainData(self.source, self.prepared, cfg.total_seq_len, cfg.train_data_ratio, cfg.seed,
                              cfg.on_damaged, cfg.verifier_name_or_path, int(cfg.keep_in_memory_gib * 2**30),
                              cfg.target_layer_ids)
        self.model = build_model(cfg, self.prepared, self.device, self.verifier)
        self.loss_kw = loss_kwargs(self.model, cfg, self.device)
        self.epoch_plan = [self._my_batches(self.data.epoch_batches(e)) for e in range(cfg.epochs)]
        self.total_steps = sum(map(len, self.epoch_plan))
        if self.total_steps == 0:
            raise InputError("no training batches", "use more data or fewer processes")
        self.opts = build_optimizers(self.model, cfg)
        self.scheds = build_schedulers(self.opts, cfg, self.total_steps)
        self.state = {"epoch": 0, "batch": 0, "step": 0, "best_val_loss": math.inf}
        self.train_s = 0.0  # wall-clock seconds trained, over every resume: the budget baselines compare at
        # Metric sums since the last log point; checkpointed, so a resume between log points
        # logs the same window an uninterrupted run does.
        self.window: dict[str, float] = {}
        # Where fit()'s time went, for benchmarks (scripts/bench_train.py); never logged or compared.
        self.timing = {"step_s": 0.0, "data_wait_s": 0.0, "read_all_s": 0.0, "validate_s": [], "save_s": []}
        self._start_or_resume(force)
        self.saved_step = self.state["step"]  # the step of the latest checkpoint
        self.log = MetricLog(self.run.metrics_path) if self.dist.main else None
        if self.dist.main and self.state["step"] > 0 and self.log.truncate_after(self.state["step"]):
            print(f"{self.log.path}: dropped a half-written last line (a write cut short by a kill or a "
                  "full disk); the resumed run logs it again", file=sys.stderr)
        if self.dist.main:
            self.tracking = Tracking.for_training(self.run.root, cfg.tracking, flatten(cfg.to_dict()), self._tags(),
                                                  self.log.read())
        self.wrapped = self.model
        if self.dist.world > 1:  # every kind's step gives each trainable weight a gradient: nothing to search for
            self.wrapped = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def unlock(self) -> None:
        """Let go of the run folder (fit() does, however it ends), after the trackers had their last records."""
        if self.tracking is not None:
            self.tracking.close()
        if self.lock is not None:
            self.lock.release()

    def _tags(self) -> dict:
        """What a tracker shows beside the config: versions and what the run trained on."""
        rec = self.run.record()
        return {"run_folder": str(self.run.root.resolve()), "store_fingerprint": rec["store_fingerprint"],
                "prepared_fingerprint": rec["prepared_fingerprint"],
                **{f"version.{k}": v for k, v in rec["versions"].items()}}

    def _log(self, record: dict) -> None:
        self.log.write(record)
        self.tracking.log(record)

    def _pass(self, name: str) -> str:
        """A data pass's name in the record of skipped samples; each rank skips on its own."""
        return name if self.dist.world == 1 else f"{name} rank {self.dist.rank}"

    def _my_batches(self, batches: list) -> list:
        """This rank's share; every rank gets the same count so collectives line up."""
        n = len(batches) // self.dist.world * self.dist.world
        return batches[self.dist.rank : n : self.dist.world]

    def _record(self) -> dict:
        return {"train": self.cfg.to_dict(), "store_fingerprint": self.source.fingerprint(),
                "prepared_fingerprint": self.prepared.fingerprint, "seed": self.cfg.seed,
                "world_size": self.dist.world, "device": str(self.device.type), "versions": versions()}

    def _start_or_resume(self, force: bool) -> None:
        rec = self.run.record()
        if rec is not None:
            diffs = TrainConfig.from_dict(rec["train"]).differences(self.cfg)
            if diffs and not force:
                raise InputError(f"run {self.run.root} was started with another config (differs in: "
                                 f"{', '.join(diffs)})", "use a new --save-path, or pass --force to resume anyway")
            # A live run's cache grows as it trains; only a fixed store must be unchanged.
            if not self.source.live and rec["store_fingerprint"] != self.source.fingerprint() and not force:
                raise StoreMismatch(f"the store changed since run {self.run.root} started",
                                    "resume against the original store, or pass --force")
        ckpt, notes = self.run.resume_point(repair=self.dist.main)
        if ckpt is None:
            if self.dist.main:
                self.run.write_record(self._record())
                self.run.metrics_path.unlink(missing_ok=True)
            return
        load_weights(self.model, ckpt, self.device)
        st = load_trainer_state(ckpt)
        for o, s in zip(self.opts, st["optimizers"]):
            o.load_state_dict(s)
        for sch, s in zip(self.scheds, st["schedulers"]):
            sch.load_state_dict(s)
        set_rng_state(st["rng"][self.dist.rank])
        self.window = dict(st.get("windows", [{}] * self.dist.world)[self.dist.rank])
        self.data.skipped = st.get("skipped", [{}] * self.dist.world)[self.dist.rank]
        self.state = st["state"]
        self.train_s = st.get("train_s", 0.0)  # 0: a checkpoint from before it was kept
        if self.dist.main:  # always said: a resume is never silent
            for note in notes:
                print(note, file=sys.stderr)
            print(f"resuming {self.run.root} from {ckpt.name} (epoch {self.state['epoch']}, "
                  f"step {self.state['step']})", file=sys.stderr)

    # --- one step, validation, checkpoint ------------------------------------
    @property
    def autocast(self) -> bool:
        return self.cfg.autocast == "bf16" or (self.cfg.autocast == "auto" and self.device.type == "cuda")

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()

    def place(self, batch: dict) -> dict:
        """A batch onto the device, in the dtype its inputs take (`input_dtype`)."""
        return to_device(batch, self.device, input_dtype(self.model, self.autocast))

    def step(self, batch: dict) -> dict:
        self.wrapped.train()
        with self._autocast():
            _, loss, metrics = self.wrapped(**self.place(model_inputs(self.cfg, batch)), **self.loss_kw)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        # Checked before the optimizer moves a weight: one NaN or infinite step makes every weight, and every
        # later checkpoint, NaN. A CPU-GPU sync point, as accumulate() already is at every step.
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            raise self._diverged(loss, grad_norm)
        for o in self.opts:
            o.step()
            o.zero_grad(set_to_none=True)
        for s in self.scheds:
            s.step()
        metrics["grad_norm_sum"], metrics["grad_norm_total"] = grad_norm.detach(), torch.ones(())
        return metrics

    def _diverged(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> TrainingDiverged:
        what = f"the loss is {loss.item()}" if not torch.isfinite(loss) else f"the gradient norm is {grad_norm.item()}"
        kept = (self.run.saved() or [None])[-1]  # what a rerun resumes from
        return TrainingDiverged(f"training diverged at step {self.state['step'] + 1} (epoch {self.state['epoch']}): {what}; "
                           + (f"the last good checkpoint {kept} is kept" if kept else "no checkpoint was saved yet"),
                           "lower --lr or --max-grad-norm (or check the data of that step), then rerun with --force: "
                           + ("training resumes from that checkpoint" if kept else "training starts over"))

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Validation under a fixed seed (anchor sampling is random) that leaves the training RNG untouched.

        Besides the loss and speculators' metrics, each batch's blocks are scored as decoding drafts them, with
        the real context states and with the controls (`blocks.py`): the state gain of every validation.
        """
        start = time.perf_counter()
        self.model.eval()
        acc: dict[str, float] = {}
        gain = self.cfg.val_state_gain and KINDS[self.cfg.speculator_type].blocks
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.seed)
            where = self._pass(f"validation at epoch {self.state['epoch']} batch {self.state['batch']}")

            def losses():  # each batch's loss and metrics as it passes; then it is scored, if asked
                for batch in Loader(self.data, self._my_batches(self.data.val_batches()) or self.data.val_batches()[:1],
                                    self.cfg.num_workers, self.cfg.prefetch_factor, where=where):
                    with self._autocast():
                        _, _, metrics = self.model(**self.place(model_inputs(self.cfg, batch)),
                                                   **self.loss_kw)
                    accumulate(acc, metrics)
                    yield batch if gain else None

            for n, batch, donors in with_donors(losses()):
                with self._autocast():  # its own seed per batch: score() leaves the generator as it was
                    scored = score_with_controls(self.model, batch, donors, self.place,
                                                 self.cfg.max_anchors, self.cfg.seed * 1_000_003 + n)
                accumulate(acc, sums(scored))
        self.timing["validate_s"].append(time.perf_counter() - start)
        out = reduce(all_reduce(acc, self.device))
        return {**out, **state_gain(out)}

    def checkpoint(self, validate: bool = True) -> None:
        """Validate (unless stopping at --max-steps: the uninterrupted run logs no val record there) and save."""
        val = (self.validate() if validate else None) or None  # {}: every validation sample was skipped
        best = val is not None and val["loss"] < self.state["best_val_loss"]
        if best:
            self.state["best_val_loss"] = val["loss"]
        ranks = [(rng_state(), dict(self.window), self.data.skipped)]  # per rank: RNG, unreduced window, skips
        if self.dist.world > 1:
            import torch.distributed as dist

            mine, ranks = ranks[0], [None] * self.dist.world
            dist.all_gather_object(ranks, mine)
        start = time.perf_counter()
        if self.dist.main:
            if self.source.live:  # the cache now holds what this run trained on, and what it skipped
                self.run.write_record({**self.run.record(), "store_fingerprint": self.source.fingerprint(),
                                       "skipped": {k: v for _, _, s in ranks for k, v in s.items()}})
            if val is not None:
                self._log({"step": self.state["step"], "epoch": self.state["epoch"], "split": "val",
                           "metrics": val})
            saved = self.run.save(self.state["step"], self.model, {
                "state": dict(self.state), "rng": [r for r, _, _ in ranks], "windows": [w for _, w, _ in ranks],
                "skipped": [s for _, _, s in ranks], "train_s": self.elapsed(),
                "optimizers": [o.state_dict() for o in self.opts],
                "schedulers": [s.state_dict() for s in self.scheds]}, best)
            self.tracking.artifact(saved)
        self.timing["save_s"].append(time.perf_counter() - start)
        self.saved_step = self.state["step"]
        if self.dist.world > 1:
            torch.distributed.barrier()

    def elapsed(self) -> float:
        """Wall-clock seconds trained: this fit's so far, plus those of the runs it resumed."""
        return self._train_s_before + time.perf_counter() - self._fit_start

    # --- the loop --------------------------------------------------------------
    def fit(self) -> dict:
        """Train to the end (or --max-steps), then let go of the run folder, as on any error."""
        try:
            return self._fit()
        finally:
            self.unlock()

    def _fit(self) -> dict:
        from tqdm import tqdm

        cfg, st = self.cfg, self.state
        self._fit_start, self._train_s_before = time.perf_counter(), self.train_s
        bar = tqdm(total=self.total_steps, initial=st["step"], desc="train", unit="step", disable=not self.progress)
        stop_at = cfg.max_steps if cfg.max_steps is not None else self.total_steps
        if st["step"] < stop_at:
            start = time.perf_counter()
            self.data.read_all(cfg.num_workers)  # when the store fits --keep-in-memory-gib
            self.timing["read_all_s"] = time.perf_counter() - start
        while st["epoch"] < cfg.epochs and st["step"] < stop_at:
            batches = self.epoch_plan[st["epoch"]]
            every = max(1, round(cfg.checkpoint_freq * len(batches)))
            # keep_empty: a batch whose samples were all skipped still moves the data position
            loader = Loader(self.data, batches[st["batch"]:], cfg.num_workers, cfg.prefetch_factor, keep_empty=True,
                            where=self._pass(f"train epoch {st['epoch']}"))
            compute = 0.0
            for batch in loader:
                stepped = batch is not None
                if not stepped and self.dist.world > 1:  # the other ranks would wait in backward forever
                    raise StoreError(f"rank {self.dist.rank} got a batch with no sample left (damaged or "
                                     "unavailable); with several processes it cannot be skipped",
                                     f"repair the store ({self.data.repair}), or bring the live source back")
                if stepped:
                    start = time.perf_counter()
                    accumulate(self.window, self.step(batch))
                    compute += time.perf_counter() - start
                    st["step"] += 1
                    bar.update()
                st["batch"] += 1
                if stepped and st["step"] % cfg.log_freq == 0:
                    metrics = reduce(all_reduce(self.window, self.device))
                    metrics["lr"] = self.scheds[0].get_last_lr()[0]
                    wait = loader.wait_seconds
                    if self.dist.main:  # timing and live counters are recorded, never compared by replay
                        record = {"step": st["step"], "epoch": st["epoch"], "split": "train", "metrics": metrics,
                                  "timing": {"data_wait_fraction": wait / max(wait + compute, 1e-9),
                                             "train_s": self.elapsed()}}
                        if self.source.stats:
                            record["live"] = self.source.stats
                        if self.data.damaged:
                            record["damaged_skipped"] = len(self.data.damaged)
                        self._log(record)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics.get('accept_len', 0):.2f}")
                    self.window = {}
                # Checkpoints are named by their step: a stretch of batches all skipped (a live source that was
                # down) trained nothing since the last one, so there is nothing new to validate or save.
                due = st["step"] != self.saved_step
                if st["batch"] == len(batches):
                    st["epoch"] += 1
                    st["batch"] = 0
                    if due:
                        self.checkpoint()
                elif st["batch"] % every == 0 and due:
                    self.checkpoint()
                if st["step"] >= stop_at:
                    break
            self.timing["step_s"] += compute
            self.timing["data_wait_s"] += loader.wait_seconds
        if st["step"] != self.saved_step:  # stopped by --max-steps: resumable from exactly here
            self.checkpoint(validate=False)
        bar.close()
        self.source.close()
        if self.dist.world > 1:
            # Every rank done with its collectives, and the DDP reducer freed, before the group goes: a reducer freed
            # after destroy_process_group once left gloo's destructor waiting on a peer that had exited (a hang at
            # exit, seen under load; pytorch#75097 reports destroy hangs that a barrier before it avoids).
            self.wrapped = self.model
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        report = self.data.damaged_report()
        if report:
            print(f"warning: {report}", file=sys.stderr)
        latest, best = self.run.checkpoint("latest"), st["best_val_loss"]
        return {"run": str(self.run.root), "steps": st["step"], "epochs_done": st["epoch"],
                "train_s": self.elapsed(),
                "best_val_loss": best if math.isfinite(best) else None,  # null: no validation yet
                "latest": str(latest) if latest else None,
                **({"live": self.source.stats} if self.source.stats else {}),
                **({"damaged_skipped": sorted(self.data.damaged)} if self.data.damaged else {}),
                **({"skipped": self.data.skipped} if self.data.skipped else {})}
