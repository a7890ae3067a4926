"""`dspark extract`: run an engine over prepared samples and hand them to the sinks.

Batches are planned deterministically from the prepared data alone, and a batch
with any missing sample is recomputed whole: a resumed run therefore feeds the
model exactly the same padded batches as an uninterrupted one, so the stored
bytes are identical, not merely close.

A resume also re-extracts stored samples whose chunk files are missing or
truncated (a cheap check, nothing decoded); `run_repair` (`dspark store repair`)
reads every sample back and re-extracts exactly the damaged and missing ones. Both
write the new copies to a fresh segment and leave the old segments as they are.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspark.connector.base import open_sink
from dspark.connector.config import SinkConfig
from dspark.connector.manifest import (StoreManifest, codec_named, default_store, manifest_for_model,
                                      require_same_weights)
from dspark.config import MooncakeConfig
from dspark.errors import InputError, StoreError, StoreMismatch, repair_command
from dspark.extract.base import open_engine
from dspark.fingerprint import tokenizer_hash
from dspark.prepare import PreparedData


@dataclass
class ExtractConfig:
    model: str
    data: str
    store: str | None  # None with --to zarr: default_store(...)
    target_layer_ids: list[int]
    to: str = "zarr"
    engine: str = "transformers"  # transformers (any device) | vllm (vllm.LLM + our KV connector)
    device: str = "cpu"
    dtype: str | None = None
    batch_tokens: int = 8192
    max_batch_size: int = 64
    encoding: str = "raw"
    codec: str | None = None  # a name in dspark.codec.CODECS; None: the store's, or the default for a new store
    chunk_tokens: int | None = None
    shard: str = "0/1"
    verifier_name: str | None = None
    trust_remote_code: bool = False
    prefix_caching: bool = True  # vllm engine: shared prompt prefixes are computed once
    tensor_parallel_size: int = 1  # vllm engine: devices per extraction process
    accept_other_weights: bool = False  # extend a store extracted with other verifier weights (its segment says so)
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)

    def sinks(self, prepared_fingerprint: str) -> SinkConfig:
        return SinkConfig(to=self.to, store=self.store, prepared_fingerprint=prepared_fingerprint,
                          verifier_name=self.verifier_name, encoding=self.encoding, codec=self.codec,
                          chunk_tokens=self.chunk_tokens,
                          writer_threads=self.mooncake.writer_threads, accept_other_weights=self.accept_other_weights,
                          mooncake=self.mooncake)


def plan_batches(data: PreparedData, batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Consecutive ids, padded size (longest x count) within the token budget."""
    batches, cur, longest = [], [], 0
    for i in range(len(data)):
        n = data.length(i)
        if cur and (max(longest, n) * (len(cur) + 1) > batch_tokens or len(cur) == max_batch_size):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def parse_shard(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in spec.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise InputError(f"bad --shard {spec!r}", "write it as INDEX/COUNT, e.g. 0/2 and 1/2") from None
    return i, n


def _existing_store(store: str | None, to: str) -> bool:
    return bool(store and "zarr" in to and (Path(store) / "manifest.json").exists())


def _stored_damage(store: str | None, to: str) -> tuple[dict[int, str], int]:
    """(stored samples whose chunk files are missing or truncated, damaged index records) of an existing store."""
    from dspark.connector.zarr_store import ZarrStore, repaired_records

    if not _existing_store(store, to):
        return {}, 0
    existing = ZarrStore(store)
    return existing.chunk_damage(), len({r[:2] for r in existing.damaged_records} - repaired_records(store))


def run_extract(cfg: ExtractConfig, progress: bool = True, rewrite: dict[int, str] | None = None) -> dict:
    """Extract every sample the sinks lack, plus `rewrite` (id -> what is wrong with its stored copy).

    `rewrite=None` finds the stored samples whose chunk files are lost or cut short.
    """
    from tqdm import tqdm

    shard_i, shard_n = parse_shard(cfg.shard)
    data = PreparedData(cfg.data)
    if cfg.store is None and "zarr" in cfg.to:
        cfg = replace(cfg, store=default_store(cfg.model, cfg.target_layer_ids, data.fingerprint))
    if data.tokenizer_hash != tokenizer_hash(Path(cfg.model)):
        raise StoreMismatch(f"prepared data {cfg.data} was tokenized with another tokenizer than {cfg.model}",
                            "rerun `dspark prepare` with this --model")
    existing = StoreManifest.load(Path(cfg.store)) if _existing_store(cfg.store, cfg.to) else None
    if existing and cfg.codec and existing.codec != codec_named(cfg.codec):
        raise InputError(f"store {cfg.store} was created with codec {existing.codec.name}, not {cfg.codec}: a "
                         "store keeps the codec it was created with",
                         f"drop --codec to extend it, or pass a new --store for {cfg.codec}")
    if existing and require_same_weights(  # before the model loads; the sink checks again
            existing, cfg.store, cfg.model, cfg.accept_other_weights):
        print(f"store {cfg.store}: extracting with other verifier weights than the store's (--accept-other-weights); "
              "the new segment records them (`dspark store info` lists it)", file=sys.stderr)
    batches = [b for j, b in enumerate(plan_batches(data, cfg.batch_tokens, cfg.max_batch_size)) if j % shard_n == shard_i]
    found, bad_records = _stored_damage(cfg.store, cfg.to)
    mine = {i for b in batches for i in b}
    rewrite = {i: why for i, why in (found if rewrite is None else rewrite).items() if i in mine}
    if rewrite:
        print(f"store {cfg.store}: {len(rewrite)} stored samples are damaged (first: sample {min(rewrite)}, "
              f"{rewrite[min(rewrite)]}); extracting them again", file=sys.stderr)
    if bad_records:
        print(f"store {cfg.store}: {bad_records} damaged index records; the samples they held are missing and "
              f"extracted again", file=sys.stderr)
    sinks = replace(cfg.sinks(data.fingerprint), rewrite=sorted(rewrite))
    engine = open_engine(cfg.engine, model=cfg.model, target_layer_ids=cfg.target_layer_ids, sinks=sinks,
                         device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                         prefix_caching=cfg.prefix_caching, tensor_parallel_size=cfg.tensor_parallel_size)
    manifest = manifest_for_model(cfg.model, cfg.target_layer_ids, data.fingerprint, cfg.encoding, cfg.chunk_tokens,
                                  cfg.verifier_name, engine.dtype_name, cfg.trust_remote_code, cfg.codec)

    sink = open_sink(cfg.to, store=cfg.store, manifest=manifest, mooncake=cfg.mooncake, rewrite=rewrite,
                     accept_other_weights=cfg.accept_other_weights)
    tokens, t0 = 0, time.perf_counter()
    try:
        todo = [b for b in batches if not all(sink.has(i) for i in b)]
        total = sum(len(b) for b in todo)
        done_before = sum(len(b) for b in batches) - total
        bar = tqdm(total=total, desc=f"extract ({cfg.engine})", unit="sample", disable=not progress)
        for batch in todo:
            engine.run([(i, data.sample(i)[0]) for i in batch], sink)
            tokens += sum(data.length(i) for i in batch)
            bar.update(len(batch))
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{tokens / dt:,.0f}", MB=f"{sink.bytes_written / 1e6:,.1f}")
        bar.close()
    finally:
        try:
            engine.close()
        finally:
            sink.close()
    elapsed = time.perf_counter() - t0
    if (engine.writes_elsewhere or rewrite) and cfg.store and "zarr" in cfg.to:  # check, never assume
        from dspark.connector.zarr_store import ZarrStore

        stored = ZarrStore(cfg.store)
        missing = [i for b in todo for i in b if i not in stored]
        if missing:
            raise StoreError(f"{len(missing)} of {total} samples were not stored (first: {missing[:5]})",
                             "see the log above for the failed writes, then rerun the same command: it extracts "
                             "only what is missing")
        still = [i for i in sorted(rewrite) if stored.damaged(i)]
        if still:
            raise StoreError(f"{len(still)} damaged samples are still damaged after extracting them again "
                             f"(first: {still[:5]})", "see the log above for the failed writes, then rerun")
    return {"store": cfg.store, "sinks": cfg.to, "engine": cfg.engine, "extracted": total,
            "already_present": done_before, "repaired": len(rewrite), "tokens": tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / max(elapsed, 1e-9))}


def run_repair(store: str, data: str, model: str, device: str = "cpu", batch_tokens: int = 8192,
               max_batch_size: int = 64, trust_remote_code: bool = False, progress: bool = True,
               accept_other_weights: bool = False) -> dict:
    """Re-extract exactly the damaged and missing samples of a store into a new segment.

    Reads every sample back (`check_store`), then runs the extraction with the
    store's own layers, encoding, chunking and dtype, rewriting only those ids; the
    batches are planned as `dspark extract` plans them, so with the original
    --batch-tokens/--max-batch-size the new copies are byte-identical on CPU. A verifier with
    other weights than the store's is refused before anything is read, unless accepted.
    """
    from dspark.connector.zarr_store import ZarrStore, check_store, note_repair

    s = ZarrStore(store)
    prepared = PreparedData(data)
    if s.manifest.prepared_fingerprint != prepared.fingerprint:
        raise StoreMismatch(f"store {store} was extracted from other prepared data than {data}",
                            "pass --data the prepared folder the store was extracted from")
    require_same_weights(s.manifest, store, model, accept_other_weights)
    found = check_store(s, len(prepared), progress=progress)
    todo = sorted(set(found.damaged) | set(found.missing))
    out = {"store": store, "damaged": len(found.damaged), "missing": len(found.missing),
           "damaged_index_records": len(found.damaged_records), "re_extracted": todo[:100]}
    if todo:
        m = s.manifest
        cfg = ExtractConfig(model=model, data=data, store=store, target_layer_ids=m.target_layer_ids, device=device,
                            dtype=m.dtype, batch_tokens=batch_tokens, max_batch_size=max_batch_size,
                            encoding=m.encoding, chunk_tokens=m.chunk_tokens, verifier_name=m.verifier_name,
                            trust_remote_code=trust_remote_code, accept_other_weights=accept_other_weights)
        out["extract"] = run_extract(cfg, progress, rewrite=found.damaged)
    after = check_store(ZarrStore(store), len(prepared), ids=todo)
    if after.damaged or after.missing:
        raise StoreError(f"store {store} still has problems after the repair: " + "; ".join(after.problems),
                         f"see the log above, then rerun {repair_command(store, data, model)}")
    if found.damaged_records:  # every sample is stored again: those records hide nothing any more
        note_repair(store, found.damaged_records, found.missing)
    return out
