"""`dspark extract`: run an engine over prepared samples and hand them to the sinks.

Batches are planned deterministically from the prepared data alone, and a batch
with any missing sample is recomputed whole: a resumed run therefore feeds the
model exactly the same padded batches as an uninterrupted one, so the stored
bytes are identical, not merely close.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import dspark.connector  # noqa: F401  (registers every sink)
from dspark.connector.base import SINKS, Sample, parse_sinks
from dspark.connector.encoding import bytes_per_token
from dspark.connector.manifest import Codec, StoreManifest
from dspark.connector.zarr_store import default_chunk_tokens
from dspark.errors import InputError, StoreMismatch
from dspark.fingerprint import model_config_hash, tokenizer_hash
from dspark.prepare import PreparedData


@dataclass
class ExtractConfig:
    model: str
    data: str
    store: str
    target_layer_ids: list[int]
    to: str = "zarr"
    device: str = "cpu"
    dtype: str | None = None
    batch_tokens: int = 8192
    max_batch_size: int = 64
    encoding: str = "raw"
    chunk_tokens: int | None = None
    shard: str = "0/1"
    verifier_name: str | None = None
    trust_remote_code: bool = False
    sink_options: dict = field(default_factory=dict)


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


def build_manifest(model: str | Path, target_layer_ids: list[int], data: PreparedData, encoding: str = "raw",
                   chunk_tokens: int | None = None, verifier_name: str | None = None, dtype: str | None = None,
                   trust_remote_code: bool = False) -> StoreManifest:
    """The store identity for states of `model` at these layers over this prepared data.

    Built from the model's config alone, so a trainer filling a cache from a live
    server agrees with an offline extraction byte for byte on what the store is.
    """
    from transformers import AutoConfig

    from dspark.extract.transformers_engine import validate_layer_ids

    model = Path(model)
    if not (model / "config.json").exists():
        raise InputError(f"model folder {model} has no config.json", "pass a local Hugging Face model folder")
    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", cfg)
    layers = validate_layer_ids(target_layer_ids, cfg.num_hidden_layers)
    dtype = dtype or str(getattr(cfg, "dtype", None) or "float32").removeprefix("torch.")
    per_token = bytes_per_token(len(layers) + 1, cfg.hidden_size, encoding, dtype)
    return StoreManifest(
        verifier_name=verifier_name or model.resolve().name,
        verifier_config_hash=model_config_hash(model),
        tokenizer_hash=tokenizer_hash(model),
        target_layer_ids=layers,
        num_hidden_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        dtype=dtype,
        encoding=encoding,
        codec=Codec(),
        chunk_tokens=chunk_tokens or default_chunk_tokens(per_token),
        prepared_fingerprint=data.fingerprint,
    )


def run_extract(cfg: ExtractConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    from dspark.extract.transformers_engine import TransformersEngine

    names = parse_sinks(cfg.to)
    shard_i, shard_n = parse_shard(cfg.shard)
    data = PreparedData(cfg.data)
    if data.tokenizer_hash != tokenizer_hash(Path(cfg.model)):
        raise StoreMismatch(f"prepared data {cfg.data} was tokenized with another tokenizer than {cfg.model}",
                            "rerun `dspark prepare` with this --model")
    engine = TransformersEngine(cfg.model, cfg.target_layer_ids, cfg.device, cfg.dtype, cfg.trust_remote_code)
    manifest = build_manifest(cfg.model, cfg.target_layer_ids, data, cfg.encoding, cfg.chunk_tokens,
                              cfg.verifier_name, engine.dtype_name, cfg.trust_remote_code)
    sinks = []
    try:
        for n in names:
            sinks.append(SINKS[n](store=cfg.store, manifest=manifest, **cfg.sink_options))
        batches = [b for j, b in enumerate(plan_batches(data, cfg.batch_tokens, cfg.max_batch_size))
                   if j % shard_n == shard_i]
        todo = [b for b in batches if not all(s.has(i) for s in sinks for i in b)]
        total = sum(len(b) for b in todo)
        done_before = sum(len(b) for b in batches) - total
        bar = tqdm(total=total, desc="extract", unit="sample", disable=not progress)
        tokens, t0 = 0, time.perf_counter()
        for batch in todo:
            ids = [data.sample(i)[0] for i in batch]
            for sid, tok, hidden in zip(batch, ids, engine.extract(ids)):
                sample = Sample(sid, tok, hidden)
                for s in sinks:
                    if not s.has(sid):
                        getattr(s, "submit", s.write)(sample)  # Mooncake puts overlap the next forward
                tokens += len(tok)
            bar.update(len(batch))
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{tokens / dt:,.0f}",
                            MB=f"{sum(getattr(s, 'bytes_written', 0) for s in sinks) / 1e6:,.1f}")
        bar.close()
    finally:
        for s in sinks:
            s.close()
    elapsed = time.perf_counter() - t0
    return {"store": cfg.store, "sinks": names, "extracted": total, "already_present": done_before,
            "tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / max(elapsed, 1e-9))}
