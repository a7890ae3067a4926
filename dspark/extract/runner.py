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

from dspark.connector.manifest import default_store
from dspark.core.errors import InputError, StoreError, StoreMismatch, repair_command
from dspark.extract.base import open_engine
from dspark.connector.base import open_store
from dspark.connector.config import SinkConfig
from dspark.extract.config import ExtractConfig, RepairConfig
from dspark.verifier.resolved import Verifier
from dspark.data.prepare import PreparedData


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


def _stored_damage(out: SinkConfig) -> tuple[dict[int, str], int]:
    """(stored samples found damaged without decoding any, damaged index records not repaired) of an existing store."""
    existing = out.open_store()
    if existing is None:
        return {}, 0
    found = existing.verify(thorough=False)  # the cheap check: a few bytes a chunk, nothing decoded
    return found.damaged, len(found.damaged_records)


def run_extract(cfg: ExtractConfig, progress: bool = True, rewrite: dict[int, str] | None = None) -> dict:
    """Extract every sample the sinks lack, plus `rewrite` (id -> what is wrong with its stored copy).

    `rewrite=None` finds the stored samples whose chunk files are lost or cut short.
    """
    from tqdm import tqdm

    shard_i, shard_n = parse_shard(cfg.shard)
    verifier = Verifier.resolve(cfg.model, trust_remote_code=cfg.trust_remote_code,
                                fix="pass --model a local Hugging Face model folder")
    data = PreparedData(cfg.data)
    out = cfg.sink
    if out.store is None and out.needs_store:
        out = out.with_store(default_store(verifier.folder, cfg.target_layer_ids, data.fingerprint))
    if data.tokenizer_hash != verifier.tokenizer_hash:
        raise StoreMismatch(f"prepared data {cfg.data} was tokenized with another tokenizer than {cfg.model}",
                            "rerun `dspark prepare` with this --model")
    existing = out.existing_manifest()  # refuses a --codec other than the store's
    if existing and existing.require_match(  # before the model loads; the sink checks again
            out.store, "use a new --store folder, or the verifier it was made from", verifier=verifier,
            accept_other_weights=out.accept_other_weights):
        print(f"store {out.store}: extracting with other verifier weights than the store's (--accept-other-weights); "
              "the new segment records them (`dspark store info` lists it)", file=sys.stderr)
    planned = plan_batches(data, cfg.batch_tokens, cfg.max_batch_size)
    batches = [b for j, b in enumerate(planned) if j % shard_n == shard_i]
    found, bad_records = _stored_damage(out)
    mine = {i for b in batches for i in b}
    rewrite = {i: why for i, why in (found if rewrite is None else rewrite).items() if i in mine}
    if rewrite:
        print(f"store {out.store}: {len(rewrite)} stored samples are damaged (first: sample {min(rewrite)}, "
              f"{rewrite[min(rewrite)]}); extracting them again", file=sys.stderr)
    if bad_records:
        print(f"store {out.store}: {bad_records} damaged index records; the samples they held are missing and "
              f"extracted again", file=sys.stderr)
    sinks = out.for_data(data.fingerprint, rewrite)
    engine = open_engine(cfg, verifier, sinks)
    manifest = sinks.manifest(verifier, cfg.target_layer_ids, data.fingerprint, engine.dtype_name)

    sink = sinks.open(manifest)
    tokens, t0 = 0, time.perf_counter()
    try:
        out.existing_manifest()  # again: a concurrent extract may have created the store since, with another codec
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
    if (engine.writes_elsewhere or rewrite) and out.needs_store:  # check, never assume
        stored, ids = out.open_store(), [i for b in todo for i in b]
        missing = ids if stored is None else stored.missing(ids)  # None: nothing was stored at all
        if missing:
            raise StoreError(f"{len(missing)} of {total} samples were not stored (first: {missing[:5]})",
                             "see the log above for the failed writes, then rerun the same command: it extracts "
                             "only what is missing")
        still = [i for i in sorted(rewrite) if stored.damaged(i)]
        if still:
            raise StoreError(f"{len(still)} damaged samples are still damaged after extracting them again "
                             f"(first: {still[:5]})", "see the log above for the failed writes, then rerun")
    return {"store": out.store, "sinks": out.to, "engine": cfg.engine, "extracted": total,
            "already_present": done_before, "repaired": len(rewrite), "tokens": tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / max(elapsed, 1e-9))}


def run_repair(cfg: RepairConfig, progress: bool = True) -> dict:
    """Re-extract exactly the damaged and missing samples of a store into a new segment.

    Reads every sample back (its source's `verify`), then runs the extraction with the
    store's own layers, encoding, chunking and dtype, rewriting only those ids; the
    batches are planned as `dspark extract` plans them, so with the original
    --batch-tokens/--max-batch-size the new copies are byte-identical on CPU. A verifier with
    other weights than the store's is refused before anything is read, unless accepted.
    """
    store, data = cfg.store, cfg.data
    verifier = Verifier.resolve(cfg.model, trust_remote_code=cfg.trust_remote_code)
    s = open_store(store)
    prepared = PreparedData(data)
    s.manifest.require_match(store, "pass --data the prepared folder the store was extracted from", verifier=verifier,
                             accept_other_weights=cfg.accept_other_weights, prepared_fingerprint=prepared.fingerprint)
    found = s.verify(expected=len(prepared), progress=progress)
    todo = sorted(set(found.damaged) | set(found.missing))
    out = {"store": store, "damaged": len(found.damaged), "missing": len(found.missing),
           "damaged_index_records": len(found.damaged_records), "re_extracted": todo[:100]}
    if todo:
        m = s.manifest
        sinks = SinkConfig.rewriting(store, m, cfg.accept_other_weights)
        extract = ExtractConfig(model=str(verifier), data=data, target_layer_ids=m.target_layer_ids, device=cfg.device,
                                dtype=m.dtype, batch_tokens=cfg.batch_tokens, max_batch_size=cfg.max_batch_size,
                                trust_remote_code=cfg.trust_remote_code, sink=sinks)
        out["extract"] = run_extract(extract, progress, rewrite=found.damaged)
    after = open_store(store).verify(todo, len(prepared))
    if after.damaged or after.missing:
        raise StoreError(f"store {store} still has problems after the repair: " + "; ".join(after.problems),
                         f"see the log above, then rerun {repair_command(store, data, cfg.model)}")
    s.repaired(found)  # every sample is stored again: the damage it found hides nothing any more
    return out
