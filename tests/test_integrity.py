"""Damaged stores: nothing damaged is trained on, verify finds every loss, repair re-extracts exactly it."""

import json
import logging
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LAYERS, run_cli, train_cfg
from dspark.connector.zarr_store import _RECORD, ZarrSink, ZarrStore, check_store
from dspark.errors import DamagedSample, StoreError
from dspark.prepare import PreparedData
from test_store import make_sample, manifest, write


# --- helpers: damage a store the ways disks and copies do ---------------------------------------

def segment(root: Path) -> str:
    (seg,) = [p.name for p in (root / "segments").iterdir()]
    return seg


def chunk_file(root: Path, seg: str, c: int, name: str = "hidden") -> Path:
    return root / "segments" / seg / name / ".".join(["c", str(c), *["0"] * {"hidden": 2, "token_ids": 0}[name]])


def in_chunk(store: ZarrStore, c: int) -> set[int]:
    C = store.manifest.chunk_tokens
    return {i for i in store.sample_ids
            if store.entry(i).start // C <= c <= (store.entry(i).start + store.entry(i).length - 1) // C}


def flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def files(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


# --- the store: index records and chunks --------------------------------------------------------

def test_a_damaged_index_record_hides_nothing_after_it(tmp_path):
    write(tmp_path, range(40))
    seg = segment(tmp_path)
    index = tmp_path / "segments" / seg / "index.bin"
    flip(index, (10 * _RECORD.size + 5) / index.stat().st_size)  # inside record 10
    with open(index, "ab") as f:
        f.write(b"\0" * _RECORD.size + struct.pack("<qq", 99, 0))  # a crash artefact: zeroed record, torn record
    store = ZarrStore(tmp_path)
    assert store.sample_ids == [i for i in range(40) if i != 10]  # 29 records after the damaged one still read
    assert store.damaged_records == [(seg, 10 * _RECORD.size, 29)]
    assert all(store.damaged(i) is None for i in store.sample_ids)
    found = check_store(store)
    assert found.damaged_records == [(seg, 320, 29)] and found.problems == [
        "1 damaged index records: the samples they held may be missing"]
    proc = run_cli("store", "verify", tmp_path, "--no-progress", check=False)
    assert proc.returncode == 2
    assert f"segment {seg}: index record 10 (byte 320) is damaged; the 29 valid records after it are read" in proc.stderr
    assert "store repair" in proc.stderr and "Traceback" not in proc.stderr


def test_flipped_lost_and_truncated_chunks_are_damaged_samples_never_data(tmp_path):
    write(tmp_path, range(60))  # chunks of 16 tokens, samples of 5..44 tokens
    store = ZarrStore(tmp_path)
    seg = segment(tmp_path)
    flipped, lost, cut = in_chunk(store, 1), in_chunk(store, 4), in_chunk(store, 8)
    flip(chunk_file(tmp_path, seg, 1))
    chunk_file(tmp_path, seg, 4).unlink()  # zarr would read a missing chunk as zeros
    whole = chunk_file(tmp_path, seg, 8).stat().st_size
    truncate(chunk_file(tmp_path, seg, 8))
    store = ZarrStore(tmp_path)
    damaged = {i: store.damaged(i) for i in store.sample_ids if store.damaged(i)}
    assert lost | cut <= set(damaged) <= flipped | lost | cut  # a flipped byte garbles part of its chunk
    assert set(damaged) & flipped - lost - cut
    assert {damaged[i] for i in lost - flipped - cut} == {f"chunk 4 of hidden in segment {seg} is missing"}
    # Blosc 1 trusts the length in its header: a truncated chunk is refused before it is decoded
    # (decoding past its end gives garbage, or a segfault on a big chunk).
    assert {damaged[i] for i in cut} == {f"chunk 8 of hidden in segment {seg} is truncated ({whole // 2} of {whole} bytes)"}
    for i in damaged:
        with pytest.raises(DamagedSample, match=rf"sample {i} in .* is damaged .*dspark store repair"):
            store.read(i)
    with pytest.raises(DamagedSample, match="is truncated"):
        store.read(min(cut), check=False)  # skipping the checksum never turns an undecodable chunk into data
    healthy = sorted(set(store.sample_ids) - set(damaged))
    assert all(torch.equal(store.read(i).hidden_states, make_sample(i).hidden_states) for i in healthy)
    # The cheap check (no decode) finds the lost and the truncated chunk, not the flipped byte.
    assert set(store.chunk_damage()) == lost | cut


def test_a_rewritten_copy_wins_over_the_damaged_one_and_healthy_segments_stay_untouched(tmp_path):
    write(tmp_path, range(30))
    seg = segment(tmp_path)
    store = ZarrStore(tmp_path)
    bad = in_chunk(store, 2)
    flip(chunk_file(tmp_path, seg, 2))
    before, fingerprint = files(tmp_path), store.fingerprint()
    sink = ZarrSink(tmp_path, manifest(), rewrite=bad)
    assert not any(sink.has(i) for i in bad) and sink.has(min(set(range(30)) - bad))
    for i in range(30):
        sink.write(make_sample(i))  # the healthy ones are skipped as stored
    sink.close()
    assert sink.samples_written == len(bad)
    after = files(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing rewritten
    store = ZarrStore(tmp_path)
    assert store.duplicates == len(bad) and store.fingerprint() == fingerprint  # the same bytes again
    for i in range(30):
        assert torch.equal(store.read(i).hidden_states, make_sample(i).hidden_states)
        assert torch.equal(store.read(i, check=False).hidden_states, make_sample(i).hidden_states)
    assert check_store(store).problems == []


# --- train and eval on a damaged copy of the session store --------------------------------------

@pytest.fixture(scope="module")
def damaged_store(store, tmp_path_factory):
    """The session store with a flipped byte, a lost chunk and a truncated chunk: (path, damaged ids)."""
    root = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(store, root)
    s, seg = ZarrStore(root), segment(root)
    C = s.manifest.chunk_tokens
    last = max((s.entry(i).start + s.entry(i).length - 1) // C for i in s.sample_ids)
    assert last >= 3, "the session store needs 4 chunks for this test"
    flip(chunk_file(root, seg, last // 3))
    chunk_file(root, seg, 2 * last // 3).unlink()
    truncate(chunk_file(root, seg, last))
    damaged = {i for i in s.sample_ids if ZarrStore(root).damaged(i)}
    assert in_chunk(s, 2 * last // 3) | in_chunk(s, last) < damaged  # and part of the flipped chunk's
    return root, damaged


def test_training_skips_damaged_samples_counts_and_names_them(damaged_store, prepared, verifier, tmp_path, capsys, caplog):
    from dspark.train.loop import Trainer
    from dspark.train.metrics import MetricLog

    root, damaged = damaged_store
    c = train_cfg(root, prepared, verifier, tmp_path / "run", epochs=1, checkpoint_freq=1.0, log_freq=1)
    with caplog.at_level(logging.WARNING, "dspark.data"):
        result = Trainer(c, progress=False).fit()
    assert set(result["damaged_skipped"]) == damaged  # every damaged sample was met (train or val) and skipped
    assert sum("is damaged" in r.getMessage() for r in caplog.records) == 1  # warned once...
    err = capsys.readouterr().err  # ...and named at the end, with the repair command
    assert f"warning: {len(damaged)} damaged samples skipped (ids {', '.join(map(str, sorted(damaged)[:20]))}" in err
    assert f"dspark store repair {root} --data {prepared} --model {verifier}" in err
    records = MetricLog(tmp_path / "run" / "metrics.jsonl", tensorboard=False).read()
    train = [r for r in records if r["split"] == "train"]
    assert train and all(np.isfinite(r["metrics"]["loss"]) for r in train)
    assert train[-1]["damaged_skipped"] > 0


def test_on_damaged_raise_stops_train_with_one_line(damaged_store, prepared, verifier, tmp_path):
    root, _ = damaged_store
    proc = run_cli("train", "--store", root, "--data-path", prepared, "--verifier-name-or-path", verifier,
                   "--save-path", tmp_path / "run", "--target-layer-ids", *LAYERS, "--max-anchors", "32",
                   "--markov-rank", "16", "--total-seq-len", "512", "--epochs", "1", "--on-damaged", "raise",
                   "--no-progress", "--device", "cpu", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "is damaged" in line and "--on-damaged raise" in line and "dspark store repair" in line
    assert "Traceback" not in proc.stderr


def test_eval_skips_or_stops_on_damaged_samples(damaged_store, store, prepared, verifier, tmp_path):
    from dspark.train.loop import Trainer

    root, damaged = damaged_store
    c = train_cfg(store, prepared, verifier, tmp_path / "run", epochs=1, checkpoint_freq=1.0)
    Trainer(c, progress=False).fit()
    args = ["eval", "--checkpoint", tmp_path / "run" / "latest", "--store", root, "--split", "all",
            "--device", "cpu", "--output", tmp_path / "ev"]
    ok = run_cli(*args, check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"{len(damaged)} damaged samples skipped" in ok.stderr and "dspark store repair" in ok.stderr
    assert set(json.loads((tmp_path / "ev" / "eval.json").read_text())["damaged_skipped"]) == damaged
    bad = run_cli(*args, "--on-damaged", "raise", check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [x for x in bad.stderr.splitlines() if x.startswith("error:")][0].count("is damaged") == 1


# --- verify against the prepared data, repair, extract's resume ---------------------------------

def test_verify_with_the_prepared_data_finds_missing_samples(store, prepared, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(store, root)
    index = root / "segments" / segment(root) / "index.bin"
    index.write_bytes(index.read_bytes()[: -2 * _RECORD.size])  # two samples never indexed
    total = len(PreparedData(prepared))
    without = run_cli("store", "verify", root, "--no-progress")
    assert "not compared with the prepared data" in without.stdout
    proc = run_cli("store", "verify", root, "--data", prepared, "--no-progress", check=False)
    assert proc.returncode == 2
    assert f"missing: 2 of {total} prepared samples, first [{total - 2}, {total - 1}]" in proc.stderr
    assert f"2 prepared samples are missing (first: [{total - 2}, {total - 1}])" in proc.stderr
    assert f"dspark store repair {root} --data {prepared}" in proc.stderr


def test_repair_re_extracts_exactly_what_is_damaged_or_missing(store, prepared, verifier, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(store, root)
    seg = segment(root)
    s = ZarrStore(root)
    lost = in_chunk(s, 0)
    chunk_file(root, seg, 0).unlink()
    flip(chunk_file(root, seg, 1))
    damaged = {i for i in s.sample_ids if ZarrStore(root).damaged(i)}
    assert lost < damaged
    index = root / "segments" / seg / "index.bin"
    records = index.stat().st_size // _RECORD.size
    unindexed = {struct.unpack_from("<q", index.read_bytes(), (records // 2) * _RECORD.size)[0]}
    flip(index, ((records // 2) * _RECORD.size + 3) / index.stat().st_size)  # a record mid-index
    before = files(root)
    out = json.loads(run_cli("store", "repair", root, "--data", prepared, "--model", verifier,
                             "--batch-tokens", 1024, "--no-progress").stdout)
    assert out["damaged"] == len(damaged) and out["missing"] == 1 and out["damaged_index_records"] == 1
    assert set(out["re_extracted"]) == damaged | unindexed
    after = files(root)
    assert {k: v for k, v in after.items() if k in before} == before  # old segments untouched, damage and all
    assert len(list((root / "segments").iterdir())) == 2
    assert run_cli("store", "verify", root, "--data", prepared, "--no-progress").returncode == 0
    assert run_cli("store", "verify", root, "--no-progress").returncode == 0  # the repair noted the index record
    a, b = ZarrStore(store), ZarrStore(root)
    assert a.sample_ids == b.sample_ids and a.fingerprint() == b.fingerprint()  # byte-identical states again
    for i in damaged | unindexed:
        assert torch.equal(a.read(i).hidden_states.view(torch.int16), b.read(i).hidden_states.view(torch.int16))
    again = json.loads(run_cli("store", "repair", root, "--data", prepared, "--model", verifier,
                               "--no-progress").stdout)
    assert again["re_extracted"] == [] and "extract" not in again


def test_extract_resume_re_extracts_lost_chunks_and_says_so(store, prepared, verifier, tmp_path):
    from dspark.extract.runner import ExtractConfig, run_extract

    root = tmp_path / "store"
    shutil.copytree(store, root)
    lost = in_chunk(ZarrStore(root), 1)
    chunk_file(root, segment(root), 1).unlink()
    cfg = ExtractConfig(model=str(verifier), data=str(prepared), store=str(root), target_layer_ids=LAYERS,
                        batch_tokens=1024)
    out = run_extract(cfg, progress=False)
    assert out["repaired"] == len(lost) and out["extracted"] >= len(lost)
    assert check_store(ZarrStore(root), len(PreparedData(prepared))).problems == []
    assert run_extract(cfg, progress=False)["extracted"] == 0


# --- the live cache: a damaged cached sample is fetched again -----------------------------------

def test_a_damaged_cached_sample_is_fetched_again_and_replaced(tmp_path, verifier, prepared):
    pytest.importorskip("mooncake.store", reason="install the mooncake extra")
    import signal

    from dspark.connector.base import SOURCES
    from dspark.connector.live import LiveConfig
    from dspark.connector.manifest import manifest_for_model
    from dspark.connector.mooncake import MooncakeConfig
    from test_live import start_extractor, start_master, stop

    master_proc, master = start_master(tmp_path)
    serve_proc, url = start_extractor(tmp_path, verifier, prepared, master, "serve")
    try:
        data = PreparedData(prepared)
        live = LiveConfig(endpoint=url, request_timeout=10, max_retries=0,
                          mooncake=MooncakeConfig(master=master, global_segment_gib=0.0625, local_buffer_gib=0.0625))

        def source():
            return SOURCES["mooncake"](store=tmp_path / "cache", manifest=manifest_for_model(
                verifier, LAYERS, data.fingerprint), prompts=data, live=live)

        first = source()
        originals = {i: first.read(i) for i in range(3)}
        first.close()
        cache = tmp_path / "cache"
        s, seg = ZarrStore(cache), segment(cache)
        chunks = [s.entry(i).start // s.manifest.chunk_tokens for i in range(3)]  # one chunk each (flushed)
        flip(chunk_file(cache, seg, chunks[0]))
        chunk_file(cache, seg, chunks[1]).unlink()
        truncate(chunk_file(cache, seg, chunks[2]))
        assert all(ZarrStore(cache).damaged(i) for i in range(3))
        second = source()
        for i in range(3):
            got = second.read(i)
            assert torch.equal(got.hidden_states.view(torch.int16), originals[i].hidden_states.view(torch.int16))
        assert second.stats["damaged_refetched"] == 3 and second.stats["generated"] == 3
        assert second.read(0) is not None and second.stats["damaged_refetched"] == 3  # replaced for good
        second.close()
        assert all(ZarrStore(cache).damaged(i) is None for i in range(3))
        assert run_cli("store", "verify", cache, "--no-progress").returncode == 0
    finally:
        stop(serve_proc, signal.SIGTERM)
        stop(master_proc)
