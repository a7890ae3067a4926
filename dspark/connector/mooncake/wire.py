"""One packed object per sample: keys, hs_connectors' layout, and the checksummed pack/unpack.

Object layout is hs_connectors' transfer format (64-byte-aligned `hidden_states
[T, L+1, H]` then `token_ids [T]`), so either side interoperates with it. The
transfer manifest (layout, sample id, xxh3 checksum, store identity) travels beside the
object: in the HTTP reply of `dspark serve`, and as a small `<key>:manifest`
object written *before* the data, so a producer-driven consumer finds it too.

Checksums are computed in cache-sized pieces while the bytes are copied (into the
put staging by `pack`, out of the get staging by `unpack`): one pass over memory
instead of two.
"""

from __future__ import annotations

from math import prod

import numpy as np
import torch
import xxhash  # ~10x faster than zlib.crc32: the checksum must not be the live path's bottleneck

from dspark.connector.base import Sample
from dspark.connector.manifest import IDENTITY_FIELDS, StoreManifest
from dspark.connector.mooncake.errors import CorruptObject
from dspark.verifier.fingerprint import sha256_json

TRANSFER_VERSION = 1  # hs_connectors' transfer-manifest version
ALIGN = 64
PIECE = 1 << 20  # copy-and-hash granule: stays in L2 between the copy and the hash


_NAMESPACES: dict[int, tuple[StoreManifest, str]] = {}  # id -> (the manifest, kept alive so ids stay unique)


def namespace(manifest: StoreManifest) -> str:
    """Keys are scoped by store identity, so two verifiers or layer sets never collide."""
    hit = _NAMESPACES.get(id(manifest))
    if hit is not None and hit[0] is manifest:  # manifests are frozen: a hash per sample is ~30 us wasted
        return hit[1]
    ns = sha256_json(manifest.model_dump(include=set(IDENTITY_FIELDS)))[:16]
    if len(_NAMESPACES) > 64:
        _NAMESPACES.clear()
    _NAMESPACES[id(manifest)] = (manifest, ns)
    return ns


def sample_key(manifest: StoreManifest, sample_id: int) -> str:
    return f"dspark/{namespace(manifest)}/{sample_id}"


def object_key(manifest: StoreManifest, sample: Sample) -> str:
    """Where a sample lives: the handle its request was given, else the key of its sample id."""
    return sample.handle or sample_key(manifest, sample.sample_id)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(num_tokens: int, manifest: StoreManifest) -> tuple[dict, int]:
    """hs_connectors' packed layout: tensor name -> shape, dtype, offset, nbytes."""
    tensors, offset = {}, 0
    for name, shape, dtype in (
            ("hidden_states", [num_tokens, len(manifest.captured_layer_ids), manifest.hidden_size], manifest.dtype),
            ("token_ids", [num_tokens], "int64")):
        nbytes = prod(shape) * getattr(torch, dtype).itemsize
        tensors[name] = {"shape": shape, "dtype": f"torch.{dtype}", "nbytes": nbytes, "offset": offset}
        offset = align(offset + nbytes)
    return tensors, offset


def transfer_params(manifest: StoreManifest, key: str, sample_id: int | None, num_tokens: int) -> dict:
    """What an extractor answers in `kv_transfer_params`: all of it known before the states exist.

    vLLM's scheduler side (our KV connector) and `dspark serve` both return exactly
    this, so a trainer cannot tell which engine answered. The checksum is known only
    after the forward: it travels in the `<key>:manifest` object.
    """
    tensors, total = layout(num_tokens, manifest)
    return {"handle": key, "version": TRANSFER_VERSION, "tensors": tensors,
            "metadata": {"num_tokens": num_tokens, "total_aligned_bytes": total, "extract_mode": "prompt_only",
                         "sample_id": None if sample_id is None else int(sample_id), "namespace": namespace(manifest)}}


def pack(sample: Sample, manifest: StoreManifest, key: str, out: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Lay the sample out in `out` (e.g. a registered staging buffer; new memory if None)."""
    T = len(sample.token_ids)
    transfer = transfer_params(manifest, key, sample.sample_id, T)
    tensors, total = transfer["tensors"], transfer["metadata"]["total_aligned_bytes"]
    buf = np.zeros(total, dtype=np.uint8) if out is None else out[:total]
    hidden = sample.hidden_states.detach().cpu().contiguous()
    digest, done = xxhash.xxh3_64(), 0
    for name, raw in (("hidden_states", hidden.view(torch.uint8).reshape(-1).numpy()),
                      ("token_ids", np.ascontiguousarray(sample.token_ids, dtype=np.int64).view(np.uint8))):
        spec = tensors[name]
        if raw.nbytes != spec["nbytes"]:
            raise CorruptObject(f"sample {sample.sample_id}: {name} has {raw.nbytes} bytes, layout says {spec['nbytes']}",
                                "extract with the store's verifier and layer ids")
        start, end = spec["offset"], spec["offset"] + spec["nbytes"]
        for lo in range(start, end, PIECE):  # copy a piece, hash it while it is in cache
            hi = min(lo + PIECE, end)
            buf[lo:hi] = raw[lo - start : hi - start]
            digest.update(buf[done:hi].data)
            done = hi
        buf[end : align(end)] = 0  # padding, deterministic
    digest.update(buf[done:].data)
    transfer["metadata"]["xxh3_64"] = digest.intdigest()
    return buf, transfer


def unpack(buf: np.ndarray, transfer: dict, manifest: StoreManifest) -> Sample:
    """Validate an object against its transfer manifest and the store identity, then decode it."""
    meta, key = transfer.get("metadata", {}), transfer.get("handle")
    if transfer.get("version") != TRANSFER_VERSION or meta.get("namespace") != namespace(manifest):
        raise CorruptObject(f"object {key} was written for another store (version/namespace differ)",
                            "point producer and consumer at the same verifier, layers and data")
    if len(buf) != meta.get("total_aligned_bytes"):
        raise CorruptObject(f"object {key} has {len(buf)} bytes, its manifest says {meta.get('total_aligned_bytes')}",
                            "the object is truncated or not ours; it is rejected and can be regenerated")
    expected, _ = layout(meta["num_tokens"], manifest)
    if transfer["tensors"] != expected:
        raise CorruptObject(f"object {key} layout {transfer['tensors']} does not match the store's {expected}",
                            "producer and consumer disagree on layers, hidden size or dtype")
    h, t = expected["hidden_states"], expected["token_ids"]
    # `buf` is reused by the next read: copy out, hashing each piece of the object while it is in cache.
    out = np.empty(h["nbytes"], dtype=np.uint8)
    digest, done = xxhash.xxh3_64(), 0
    for lo in range(h["offset"], h["offset"] + h["nbytes"], PIECE):
        hi = min(lo + PIECE, h["offset"] + h["nbytes"])
        out[lo - h["offset"] : hi - h["offset"]] = buf[lo:hi]
        digest.update(buf[done:hi].data)
        done = hi
    digest.update(buf[done:].data)
    if digest.intdigest() != meta.get("xxh3_64"):
        raise CorruptObject(f"object {key} fails its checksum", "it is rejected and can be regenerated")
    hidden = torch.from_numpy(out).view(getattr(torch, manifest.dtype)).view(*h["shape"])
    tokens = buf[t["offset"] : t["offset"] + t["nbytes"]].view(np.int64).copy()
    return Sample(-1 if meta["sample_id"] is None else int(meta["sample_id"]), tokens, hidden, handle=key)
