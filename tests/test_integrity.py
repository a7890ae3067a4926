"""Damaged stores: nothing damaged is trained on, verify finds every loss, repair re-extracts exactly it."""

import json
import logging
import os
import resource
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LAYERS, run_cli, run_process, train_cfg
from dspark.verifier.resolved import Verifier
from dspark.connector.zarr.format import INDEX_RECORD
from dspark.connector.zarr.reader import ZarrStore
from dspark.connector.zarr.writer import ZarrSink
from dspark.core.errors import DamagedSample, StoreMismatch
from dspark.data.prepare import PreparedData
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


def replace_with(path: Path, kind: str) -> None:
    """Put what a hostile or broken copy might leave at `path`: /dev/zero, a FIFO, or the file grown sparse to 20 GB."""
    if kind == "sparse":
        with open(path, "r+b") as f:
            f.truncate(20 << 30)
        return
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    else:
        path.symlink_to(kind)


def run_bounded(*args, gib: float = 1.5, timeout: float = 300):
    """`dspark` in a child process that may map at most `gib` GiB: a read that is not bounded fails fast."""
    limit = int(gib * 2**30)
    return run_process(*args, why="a memory limit holds for a whole process", check=False, timeout=timeout,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))


# --- the store: index records and chunks --------------------------------------------------------

def test_a_damaged_index_record_hides_nothing_after_it(tmp_path):
    write(tmp_path, range(40))
    seg = segment(tmp_path)
    index = tmp_path / "segments" / seg / "index.bin"
    flip(index, (10 * INDEX_RECORD.size + 5) / index.stat().st_size)  # inside record 10
    with open(index, "ab") as f:
        f.write(b"\0" * INDEX_RECORD.size + struct.pack("<qq", 99, 0))  # a crash artefact: zeroed record, torn record
    store = ZarrStore(tmp_path)
    assert store.sample_ids == [i for i in range(40) if i != 10]  # 29 records after the damaged one still read
    assert store.damaged_records == [(seg, 10 * INDEX_RECORD.size, 29)]
    assert all(store.damaged(i) is None for i in store.sample_ids)
    found = store.verify()
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
    assert store.verify().problems == []


def test_chunks_that_are_not_regular_files_or_too_long_are_damaged_samples_never_read_whole(tmp_path):
    write(tmp_path, range(60))  # samples of 5..44 tokens in chunks of 16: chunks 4 apart share no sample
    store, seg = ZarrStore(tmp_path), segment(tmp_path)
    hit = {c: in_chunk(store, c) for c in (1, 5, 9, 13)}
    whole = {c: chunk_file(tmp_path, seg, c).stat().st_size for c in hit}
    replace_with(chunk_file(tmp_path, seg, 1), "/dev/zero")
    replace_with(chunk_file(tmp_path, seg, 5), "fifo")
    replace_with(chunk_file(tmp_path, seg, 9), "sparse")
    with open(chunk_file(tmp_path, seg, 13), "ab") as f:
        f.write(b"x" * 100)
    where = {c: f"chunk {c} of hidden in segment {seg}" for c in hit}
    want = {**{i: f"{where[1]} is not a regular file (a character device)" for i in hit[1]},
            **{i: f"{where[5]} is not a regular file (a FIFO)" for i in hit[5]},
            **{i: f"{where[9]} is longer than its header says ({20 << 30} of {whole[9]} bytes)" for i in hit[9]},
            **{i: f"{where[13]} is longer than its header says ({whole[13] + 100} of {whole[13]} bytes)"
               for i in hit[13]}}
    proc = run_bounded("store", "verify", tmp_path, "--no-progress", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert {line for line in proc.stderr.splitlines() if line.startswith("sample ")} == {
        f"sample {i}: {why}" for i, why in want.items()}
    store = ZarrStore(tmp_path)
    assert store.chunk_damage() == want  # the cheap check (a resume) sees all of it, reading 16 bytes a chunk
    for i in want:
        with pytest.raises(DamagedSample, match=rf"sample {i} in .* is damaged"):
            store.read(i, check=False)


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "sparse"])
@pytest.mark.parametrize("name", ["manifest.json", "index.bin"])
def test_a_manifest_or_index_that_is_not_a_regular_file_or_too_big_is_one_error_line(tmp_path, name, kind):
    write(tmp_path, range(5))
    path = tmp_path / name if name == "manifest.json" else tmp_path / "segments" / segment(tmp_path) / name
    replace_with(path, kind)
    proc = run_bounded("store", "info", tmp_path, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    problem = {"/dev/zero": "is not a regular file (a character device)", "fifo": "is not a regular file (a FIFO)",
               "sparse": f"is {20 << 30} bytes, more than the"}[kind]
    assert line.startswith(f"error: {path} {problem}")


@pytest.mark.slow
def test_train_and_repair_take_a_chunk_of_dev_zero_or_20_gb_as_damaged_samples(store, prepared, verifier, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(store, root)
    s, seg = ZarrStore(root), segment(root)
    whole = chunk_file(root, seg, 2).stat().st_size
    replace_with(chunk_file(root, seg, 0), "/dev/zero")
    replace_with(chunk_file(root, seg, 2), "sparse")
    want = {**{i: f"chunk 0 of hidden in segment {seg} is not a regular file (a character device)"
               for i in in_chunk(s, 0)},
            **{i: f"chunk 2 of hidden in segment {seg} is longer than its header says ({20 << 30} of {whole} bytes)"
               for i in in_chunk(s, 2)}}
    verify = run_bounded("store", "verify", root, "--no-progress")
    assert verify.returncode == 2 and "Traceback" not in verify.stderr, verify.stderr[-2000:]
    assert [line for line in verify.stderr.splitlines() if line.startswith("sample ")] == [
        f"sample {i}: {want[i]}" for i in sorted(want)[:20]]  # verify names the first 20
    train = run_bounded("train", "--store", root, "--data-path", prepared, "--verifier-name-or-path", verifier,
                        "--save-path", tmp_path / "run", "--target-layer-ids", *LAYERS, "--max-anchors", "32",
                        "--markov-rank", "16", "--total-seq-len", "512", "--epochs", "1", "--max-steps", "1",
                        "--no-progress", "--device", "cpu", gib=4)
    assert train.returncode == 0 and "Traceback" not in train.stderr and "MemoryError" not in train.stderr, \
        train.stderr[-2000:]
    assert json.loads(train.stdout)["damaged_skipped"] == sorted(want)
    repair = run_bounded("store", "repair", root, "--data", prepared, "--model", verifier, "--batch-tokens", 1024,
                         "--no-progress", gib=4)
    assert repair.returncode == 0, repair.stderr[-2000:]
    assert json.loads(repair.stdout)["re_extracted"] == sorted(want)
    assert run_bounded("store", "verify", root, "--no-progress").returncode == 0


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
    records = MetricLog(tmp_path / "run" / "metrics.jsonl").read()
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


@pytest.mark.slow
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
    index.write_bytes(index.read_bytes()[: -2 * INDEX_RECORD.size])  # two samples never indexed
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
    records = index.stat().st_size // INDEX_RECORD.size
    unindexed = {struct.unpack_from("<q", index.read_bytes(), (records // 2) * INDEX_RECORD.size)[0]}
    flip(index, ((records // 2) * INDEX_RECORD.size + 3) / index.stat().st_size)  # a record mid-index
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
    from dspark.connector.config import SinkConfig, ZarrConfig
    from dspark.extract.config import ExtractConfig
    from dspark.extract.runner import run_extract

    root = tmp_path / "store"
    shutil.copytree(store, root)
    lost = in_chunk(ZarrStore(root), 1)
    chunk_file(root, segment(root), 1).unlink()
    cfg = ExtractConfig(model=str(verifier), data=str(prepared), sink=SinkConfig(zarr=ZarrConfig(store=str(root))),
                        target_layer_ids=LAYERS, batch_tokens=1024)
    out = run_extract(cfg, progress=False)
    assert out["repaired"] == len(lost) and out["extracted"] >= len(lost)
    assert ZarrStore(root).verify(expected=len(PreparedData(prepared))).problems == []
    assert run_extract(cfg, progress=False)["extracted"] == 0


# --- the live cache: a damaged cached sample is fetched again -----------------------------------

def test_a_damaged_cached_sample_is_fetched_again_and_replaced(tmp_path, verifier, prepared, live_master, live_serve):
    """On the session's master and `dspark serve`: this test's cache is its own, so each miss is its own request."""
    from dspark.connector.registry import SOURCES
    from dspark.connector.live import LiveConfig
    from dspark.connector.manifest import manifest_for_model
    from dspark.connector.config import MooncakeConfig

    master, url = live_master.up(), live_serve.up()
    data = PreparedData(prepared)
    live = LiveConfig(endpoint=url, request_timeout=10, max_retries=0,
                      mooncake=MooncakeConfig(master=master, global_segment_gib=0.0625, local_buffer_gib=0.0625))

    def source():
        return SOURCES["mooncake"](store=tmp_path / "cache", manifest=manifest_for_model(
            Verifier.resolve(verifier), LAYERS, data.fingerprint, encoding="raw"), prompts=data, live=live)

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


# --- the verifier's weights are part of the store's identity ------------------------------------

@pytest.fixture(scope="module")
def other_verifier(verifier, tmp_path_factory) -> Path:
    """The session verifier with one tensor changed: same config, tokenizer, safetensors header and size."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("other") / "tiny"
    shutil.copytree(verifier, out)
    weights = load_file(out / "model.safetensors")
    name = sorted(k for k in weights if "layers" in k)[-1]
    weights[name] = weights[name] + 0.05
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    assert (out / "model.safetensors").stat().st_size == (verifier / "model.safetensors").stat().st_size
    return out


@pytest.mark.slow
def test_a_verifier_with_other_weights_is_refused_by_repair_extract_and_train_unless_accepted(
        store, prepared, verifier, other_verifier, tmp_path):
    from dspark.connector.config import SinkConfig, ZarrConfig
    from dspark.extract.config import ExtractConfig
    from dspark.extract.runner import run_extract
    from dspark.train.loop import require_matching_store

    root = tmp_path / "store"
    shutil.copytree(store, root)
    lost = in_chunk(ZarrStore(root), 0)
    chunk_file(root, segment(root), 0).unlink()
    before = files(root)
    repair = ["store", "repair", root, "--data", prepared, "--model", other_verifier, "--batch-tokens", 1024,
              "--no-progress"]
    proc = run_cli(*repair, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert f"store {root} was extracted with other verifier weights than {other_verifier}" in line
    assert "--accept-other-weights" in line
    with pytest.raises(StoreMismatch, match="other verifier weights"):
        run_extract(ExtractConfig(model=str(other_verifier), data=str(prepared),
                                  sink=SinkConfig(zarr=ZarrConfig(store=str(root))),
                                  target_layer_ids=LAYERS, batch_tokens=1024), progress=False)
    with pytest.raises(StoreMismatch, match="other verifier weights"):
        require_matching_store(ZarrStore(root), train_cfg(root, prepared, other_verifier, tmp_path / "run"),
                               Verifier.resolve(other_verifier))
    assert files(root) == before  # nothing written
    accepted = train_cfg(root, prepared, other_verifier, tmp_path / "run", accept_other_weights=True)
    require_matching_store(ZarrStore(root), accepted, Verifier.resolve(other_verifier))
    assert accepted.to_dict()["accept_other_weights"] is True  # what the run records in its config.json
    out = json.loads(run_cli(*repair, "--accept-other-weights").stdout)
    assert out["re_extracted"] == sorted(lost)
    info = json.loads(run_cli("store", "info", root).stdout)
    (new,) = {p.name for p in (root / "segments").iterdir()} - {segment(store)}
    assert [s["segment"] for s in info["segments_with_other_weights"]] == [new]
    assert run_cli("store", "verify", root, "--no-progress").returncode == 0
