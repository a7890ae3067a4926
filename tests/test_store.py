import multiprocessing as mp
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from dspark.connector.base import Sample
from dspark.connector.manifest import StoreManifest
from dspark.connector.zarr.reader import ZarrStore
from dspark.connector.zarr.writer import ZarrSink
from dspark.core.errors import StoreError, StoreMismatch

L, H = 4, 32


def manifest(**kw) -> StoreManifest:
    base = dict(verifier_name="toy", verifier_config_hash="c", tokenizer_hash="t", target_layer_ids=[1, 2, 3],
                num_hidden_layers=4, hidden_size=H, dtype="bfloat16", chunk_tokens=16, prepared_fingerprint="p")
    return StoreManifest(**{**base, **kw})


def make_sample(i: int, n: int | None = None) -> Sample:
    g = torch.Generator().manual_seed(i)
    n = n or 5 + (i * 7) % 40
    hidden = (torch.randn(n, L, H, generator=g) * (1 + torch.arange(L)).view(1, L, 1) * 3).to(torch.bfloat16)
    return Sample(i, np.arange(n, dtype=np.int64) + i, hidden)


def write(root, ids, **kw) -> ZarrSink:
    sink = ZarrSink(root, manifest(**kw))
    for i in ids:
        sink.write(make_sample(i))
    sink.close()
    return sink


def test_bf16_round_trip_is_bit_exact(tmp_path):
    write(tmp_path, range(30))
    store = ZarrStore(tmp_path)
    assert store.sample_ids == list(range(30))
    for i in [0, 7, 29, 13]:  # random access
        got, want = store.read(i, check=True), make_sample(i)
        assert torch.equal(got.hidden_states.view(torch.int16), want.hidden_states.view(torch.int16))
        assert got.hidden_states.dtype == torch.bfloat16 and np.array_equal(got.token_ids, want.token_ids)
    assert [s.sample_id for s in store.iter_samples(read_ahead=3)] == list(range(30))
    info = store.info()
    assert info["samples"] == 30 and info["raw_bytes"] == sum(make_sample(i).hidden_states.nbytes for i in range(30))


def test_a_sample_of_another_dtype_than_the_stores_is_refused_not_stored_as_wrong_bits(tmp_path):
    sink = ZarrSink(tmp_path, manifest())
    s = make_sample(0)
    with pytest.raises(StoreError, match="torch.float32 hidden states, store .* holds bfloat16"):
        sink.write(Sample(0, s.token_ids, s.hidden_states.float()))
    sink.write(s)
    sink.close()
    assert torch.equal(ZarrStore(tmp_path).read(0).hidden_states, s.hidden_states)


def test_fp8_round_trip_within_tolerance(tmp_path):
    write(tmp_path / "fp8", range(10), encoding="fp8_e4m3")
    store = ZarrStore(tmp_path / "fp8")
    for i in range(10):
        got, want = store.read(i, check=True).hidden_states.float(), make_sample(i).hidden_states.float()
        amax = want.abs().amax(-1, keepdim=True)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus the subnormal step.
        assert ((got - want).abs() <= want.abs() / 16 + amax / 448 * 2**-6 + 1e-2 * amax / 448).all()
    write(tmp_path / "bf16", range(10))
    assert store.disk_bytes() < 0.7 * ZarrStore(tmp_path / "bf16").disk_bytes()


def test_stock_zarr_python_reads_what_dspark_writes(tmp_path):
    """dspark writes chunk files itself (not through zarr): zarr must still read every array as written."""
    import zarr

    from dspark.connector.encoding import encode

    for encoding in ("raw", "fp8_e4m3"):
        root = tmp_path / encoding
        write(root, range(12), encoding=encoding)
        store = ZarrStore(root)
        (seg,) = (root / "segments").iterdir()
        arrays = {name: zarr.open_array(seg / name, mode="r") for name in ("hidden", "token_ids", "scales")
                  if (seg / name).exists()}
        for i in range(12):
            e, want = store.entry(i), make_sample(i)
            sl = slice(e.start, e.start + e.length)
            payload, scales = encode(want.hidden_states, encoding)
            assert np.array_equal(arrays["hidden"][sl], payload)
            assert np.array_equal(arrays["token_ids"][sl], want.token_ids)
            if encoding == "fp8_e4m3":
                assert np.array_equal(arrays["scales"][sl], scales)


def test_the_segment_records_the_engine_its_sink_config_names_through_vllms_extra_config(tmp_path):
    """The vLLM engine's runner and version reach its workers' sinks as JSON, and each segment they write keeps them."""
    import zarr

    from dspark.connector.config import SinkConfig, ZarrConfig

    engine = {"vllm_version": "0.33.0", "vllm_model_runner": "v2"}
    written = SinkConfig(zarr=ZarrConfig(store=str(tmp_path), segment_attrs=engine))
    cfg = SinkConfig.from_extra_config(written.to_extra_config())
    sink = cfg.open(manifest())
    sink.write(make_sample(0))
    sink.close()
    (seg,) = (tmp_path / "segments").iterdir()
    attrs = zarr.open_array(seg / "hidden", mode="r").attrs
    assert {k: attrs[k] for k in engine} == engine and attrs["logical_dtype"] == "bfloat16"


def test_a_store_written_with_slash_chunk_keys_still_reads(tmp_path):
    """Stores before this layout keep chunks at c/<c>/0/0; the reader follows each array's metadata."""
    import json

    write(tmp_path, range(12))
    (seg,) = (tmp_path / "segments").iterdir()
    for name in ("hidden", "token_ids"):
        meta = json.loads((seg / name / "zarr.json").read_text())
        meta["chunk_key_encoding"]["configuration"]["separator"] = "/"
        (seg / name / "zarr.json").write_text(json.dumps(meta))
        for f in (seg / name).glob("c.*"):
            dest = seg / name / Path(*f.name.split("."))
            dest.parent.mkdir(parents=True, exist_ok=True)
            f.rename(dest)
    store = ZarrStore(tmp_path)
    assert store.chunk_damage() == {}
    for i in range(12):
        assert torch.equal(store.read(i).hidden_states.view(torch.int16), make_sample(i).hidden_states.view(torch.int16))


def test_new_stores_checksum_with_xxh3_and_stores_from_before_keep_crc32(tmp_path):
    import json
    import zlib

    from dspark.connector.checksum import PIECE, sample_checksum

    new, old = tmp_path / "new", tmp_path / "old"
    big = Sample(99, np.arange(9000, dtype=np.int64), torch.randn(9000, L, H).to(torch.bfloat16))  # 2.3 MB
    for root, kw in ((new, {}), (old, {"checksum": "crc32"})):
        write(root, range(6), **kw)
        sink = ZarrSink(root, manifest(**kw))
        sink.write(big)
        sink.close()
    path = old / "manifest.json"  # as a store from before checksums were named: no "checksum" key
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "checksum"}))
    stores = {"xxh3_64": ZarrStore(new), "crc32": ZarrStore(old)}
    assert {k: s.manifest.checksum for k, s in stores.items()} == {"xxh3_64": "xxh3_64", "crc32": "crc32"}
    for kind, store in stores.items():
        for s in [*map(make_sample, range(6)), big]:
            payload = s.hidden_states.view(torch.uint16).numpy()
            assert store.entry(s.sample_id).crc == sample_checksum(kind, s.token_ids, payload, None)
            assert store.damaged(s.sample_id) is None
    want = zlib.crc32(payload.tobytes(), zlib.crc32(big.token_ids.tobytes()))
    assert stores["crc32"].entry(99).crc == want  # CRC32 exactly as stores from before computed it
    assert payload.nbytes > 2 * PIECE  # the xxh3 tree spans three pieces
    # Damage is caught in both kinds: flip one byte in the middle of a chunk of the big sample.
    damaged_at = {}
    for root in (new, old):
        e = damaged_at[root] = ZarrStore(root).entry(99)
        chunk = root / "segments" / e.segment / "hidden" / f"c.{(e.start + 4000) // 16}.0.0"
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        chunk.write_bytes(bytes(raw))
        assert ZarrStore(root).damaged(99) and ZarrStore(root).damaged(3) is None
    # Position-independent: a repair's copy at another offset of another segment has the same checksum,
    # and reads back where the damaged first copy does not.
    # Its segment is named to sort first (segments made in the same second sort by a random suffix):
    # the valid copy is read whichever record comes first.
    sink = ZarrSink(new, manifest(), writer_id="0-repair", rewrite=[3, 99])
    sink.write(make_sample(3))
    sink.write(big)
    sink.close()
    hurt, again = sorted(ZarrStore(new)._view.records(99), key=lambda r: r != damaged_at[new])
    assert hurt.start % 16 != again.start % 16  # other chunk boundaries
    assert again.crc == hurt.crc == stores["xxh3_64"].entry(99).crc
    repaired = ZarrStore(new)
    assert repaired.damaged(99) is None and repaired.entry(99) == again


def test_extract_codec_is_recorded_and_read_by_stock_zarr_and_a_store_keeps_its_own(tmp_path):
    import zarr

    from dspark.connector.manifest import codec_named
    from dspark.core.errors import InputError

    sink = ZarrSink(tmp_path, manifest(codec=codec_named("lz4")))
    for i in range(5):
        sink.write(make_sample(i))
    sink.close()
    store = ZarrStore(tmp_path)
    assert store.manifest.codec.name == "lz4" and store.manifest.codec.cname == "lz4"
    seg = tmp_path / "segments" / sink._writer_id
    z = zarr.open_array(seg / "hidden", mode="r")
    (blosc,) = [c for c in z.metadata.codecs if type(c).__name__ == "BloscCodec"]
    assert blosc.cname.value == "lz4" and blosc.shuffle.value == "shuffle"
    e = store.entry(3)
    assert np.array_equal(z[e.start : e.start + e.length], make_sample(3).hidden_states.view(torch.uint16).numpy())
    assert torch.equal(store.read(3).hidden_states.view(torch.int16), make_sample(3).hidden_states.view(torch.int16))
    with pytest.raises(InputError, match="unknown codec 'brotli'.*zstd, lz4"):
        codec_named("brotli")


def test_read_buffers_are_recycled_only_once_nothing_refers_to_them(tmp_path, monkeypatch):
    from dspark.connector.buffers import READS, BufferPool

    def address(a) -> int:
        return a.data_ptr() if isinstance(a, torch.Tensor) else a.__array_interface__["data"][0]

    pool = BufferPool(max_bytes=100, min_bytes=0)
    a, b = pool.empty((10,), np.uint16), pool.empty((10,), np.uint16)
    assert address(a) != address(b)  # a is in use
    at, owner = address(a), id(a.base)  # the pooled buffer: the pool keeps it, so its id stays its own
    view = torch.from_numpy(a[2:]).view(torch.int16)  # a tensor of a view of it keeps it in use
    del a
    assert address(pool.empty((10,), np.uint16)) not in (at, address(b))
    del view
    again = pool.empty((8,), np.uint16)
    assert address(again) == at and id(again.base) == owner  # idle now: reused, not allocated
    del again
    keep = pool.empty((40,), np.uint16)  # 80 bytes: the idle 20-byte buffers make room
    assert pool.held <= 100 and pool.empty((40,), np.uint16).base is None  # full: a plain array
    del keep

    # Through the store, bf16 and fp8: a sample held keeps its values while later reads reuse other buffers.
    monkeypatch.setattr(READS, "min_bytes", 0)
    for encoding in ("raw", "fp8_e4m3"):
        write(tmp_path / encoding, range(6), encoding=encoding)
        store = ZarrStore(tmp_path / encoding)
        held = store.read(0).hidden_states
        want = held.clone()
        again = [address(store.read(3).hidden_states) for _ in range(3)]  # each dropped at once: recycled
        assert again[0] == again[1] == again[2] != address(held)
        for i in range(1, 6):
            assert torch.equal(store.read(i).hidden_states.view(torch.int16),
                               store.read(i).hidden_states.clone().view(torch.int16))
        assert torch.equal(held.view(torch.int16), want.view(torch.int16))  # never handed out while held
        if encoding == "raw":
            assert torch.equal(held.view(torch.int16), make_sample(0).hidden_states.view(torch.int16))


def test_fp8_decode_is_the_float_formula_for_every_code():
    """The fast decode (float16 bit trick, cache-sized pieces) equals fp8 * scale rounded once to bf16."""
    from dspark.connector.encoding import decode

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # every finite e4m3 code
    payload = np.tile(codes, (3, 2, 1))  # [T=3, L=2, 254]
    scales = np.array([[1.0, 0.37], [3e-5, 7.9e3], [2.0**-20, 448.0]], dtype=np.float32)
    want = (torch.from_numpy(payload).view(torch.float8_e4m3fn).float()
            * torch.from_numpy(scales).unsqueeze(-1)).to(torch.bfloat16)
    got = decode(payload, scales, "fp8_e4m3", "bfloat16")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_index_records_follow_write_order_though_chunks_are_written_in_parallel(tmp_path):
    sink = ZarrSink(tmp_path, manifest(chunk_tokens=4))  # many chunks per sample, several in flight
    futures = [sink.write(make_sample(i)) for i in range(40)]
    sink.close()
    assert all(f.done() and f.exception() is None for f in futures)
    (seg,) = (tmp_path / "segments").iterdir()
    data = (seg / "index.bin").read_bytes()
    assert [struct.unpack_from("<q", data, off)[0] for off in range(0, len(data), 32)] == list(range(40))


def test_torn_index_tail_and_damage_are_detected(tmp_path):
    write(tmp_path, range(12))
    seg = next((tmp_path / "segments").iterdir())
    with open(seg / "index.bin", "ab") as f:  # a writer killed mid-record
        f.write(struct.pack("<qq", 99, 0))
    assert ZarrStore(tmp_path).sample_ids == list(range(12))
    chunk = seg / "hidden" / "c.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    store = ZarrStore(tmp_path)
    damaged = {i for i in store.sample_ids if store.damaged(i)}
    in_chunk0 = {i for i in store.sample_ids if store.entry(i).start < 16}
    assert damaged and damaged <= in_chunk0
    proc = run_cli("store", "verify", tmp_path, "--no-progress", check=False)
    assert proc.returncode != 0 and "damaged" in proc.stderr


def _writer(root, ids):
    write(root, ids)


@pytest.mark.slow
def test_two_concurrent_writers(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, range(k, 60, 2))) for k in (0, 1)]
    procs += [ctx.Process(target=_writer, args=(tmp_path, range(20, 40)))]  # overlaps both
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = ZarrStore(tmp_path)
    # Overlapping ids: each is stored at least once, at most once per writer that had not seen it yet.
    assert store.sample_ids == list(range(60)) and 0 <= store.duplicates <= 20
    assert all(store.damaged(i) is None for i in range(60))
    for i in range(0, 60, 9):
        assert torch.equal(store.read(i).hidden_states, make_sample(i).hidden_states)


def test_manifest_mismatch_is_refused_with_the_difference(tmp_path):
    write(tmp_path, range(3))
    with pytest.raises(StoreMismatch, match=r"target_layer_ids: store has \[1, 2, 3\], wanted \[1, 2, 4\]"):
        ZarrSink(tmp_path, manifest(target_layer_ids=[1, 2, 4]))
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text().replace('"format_version": 1', '"format_version": 99'))
    with pytest.raises(StoreMismatch, match="format version 99"):
        ZarrStore(tmp_path)


def test_a_new_store_goes_only_into_a_new_or_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"is not empty and is not a dspark store \(no manifest.json; it holds "
                                         r"notes.txt\)"):
        ZarrSink(tmp_path, manifest())  # every sink path (extract, serve, the live cache, vLLM) opens one
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    write(tmp_path, range(3))  # empty: created; then reopened as the store it now is
    write(tmp_path, range(3, 6))
    assert ZarrStore(tmp_path).sample_ids == list(range(6))


def test_not_a_store(tmp_path):
    with pytest.raises(StoreError, match="not a dspark store"):
        ZarrStore(tmp_path)


def test_disk_full_keeps_the_store_valid(tiny_fs):
    root = tiny_fs / "store"
    sink = ZarrSink(root, manifest())
    with pytest.raises(StoreError, match="free disk space"):
        for i in range(100_000):
            sink.write(make_sample(i, n=64))
    store = ZarrStore(root)
    assert len(store) > 10
    assert all(store.damaged(i) is None for i in store.sample_ids)
    # the failed chunk writes removed their temp files
    assert not list(root.rglob("*.tmp"))


def test_bad_manifest_values_are_one_line_naming_each_field_and_its_allowed_values(tmp_path):
    import json

    write(tmp_path, range(3))
    path = tmp_path / "manifest.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps({**good, "dtype": "float64", "encoding": "bogus", "hidden_size": -128}))
    proc = run_cli("store", "verify", tmp_path, "--no-progress", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: store {tmp_path} has a damaged manifest.json: ")
    assert "dtype: Input should be 'bfloat16', 'float16' or 'float32' (got 'float64')" in line
    assert "encoding: Input should be 'raw' or 'fp8_e4m3' (got 'bogus')" in line
    assert "hidden_size: Input should be greater than 0 (got -128)" in line
    del good["chunk_tokens"]
    for text, what in ((json.dumps(good), "chunk_tokens: Field required"), ("{not json", "is not JSON"),
                       ("[1, 2]", "is not a JSON object")):
        path.write_text(text)
        with pytest.raises(StoreError, match=rf"has a damaged manifest.json: .*{what}"):
            ZarrStore(tmp_path)


def test_a_store_written_before_weights_were_recorded_reads_extends_and_keeps_its_fingerprint(tmp_path):
    import json

    write(tmp_path, range(5), checksum="crc32")
    path = tmp_path / "manifest.json"
    old = json.loads(path.read_text())
    for key in ("verifier_weights_hash", "checksum"):  # as every store written before they were recorded
        old.pop(key)
    path.write_text(json.dumps(old))
    store = ZarrStore(tmp_path)
    assert store.manifest.verifier_weights_hash is None
    assert store.fingerprint() == "9998c99e3fd4713af10562431194eefd2152c16fa8072c7d5fc023b5b01a8327"  # as before
    write(tmp_path, range(5, 8), verifier_weights_hash="xxh3-128:any")  # nothing recorded to compare with
    assert ZarrStore(tmp_path).sample_ids == list(range(8))


def test_a_writer_with_other_verifier_weights_is_refused_unless_accepted_and_then_recorded(tmp_path):
    write(tmp_path, range(5), verifier_weights_hash="xxh3-128:aaaa")
    with pytest.raises(StoreMismatch, match=r"verifier weights: store has xxh3-128:aaaa, wanted xxh3-128:bbbb .*"
                                            r"--accept-other-weights"):
        ZarrSink(tmp_path, manifest(verifier_weights_hash="xxh3-128:bbbb"))
    assert ZarrStore(tmp_path).info()["segments_with_other_weights"] == []
    sink = ZarrSink(tmp_path, manifest(verifier_weights_hash="xxh3-128:bbbb"), accept_other_weights=True)
    sink.write(make_sample(5))
    sink.close()
    store = ZarrStore(tmp_path)
    assert store.sample_ids == list(range(6)) and store.manifest.verifier_weights_hash == "xxh3-128:aaaa"
    assert store.info()["segments_with_other_weights"] == [{"segment": sink._writer_id,
                                                           "verifier_weights_hash": "xxh3-128:bbbb"}]


def test_the_weights_hash_sees_every_byte_and_refuses_a_weight_file_that_is_not_regular(tmp_path):
    from dspark.core.errors import InputError
    from dspark.verifier.fingerprint import weights_hash

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 3_000_000)
    before = weights_hash(tmp_path)
    (tmp_path / "new").write_bytes(b"\0" * 2_999_999 + b"\1")  # same name and size, one byte differs
    (tmp_path / "new").replace(weights)
    assert weights_hash(tmp_path) != before
    weights.unlink()
    weights.symlink_to("/dev/zero")  # hashing it would never end
    with pytest.raises(InputError, match=r"model.safetensors is not a regular file \(a character device\)"):
        weights_hash(tmp_path)
