"""The output rule (dspark.core.outputs): no command replaces what it was not given; creators of one output take turns."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import LAYERS, run_cli, write_jsonl
from dspark.verifier.resolved import Verifier
from dspark.core.errors import InputError
from dspark.data.holdout import split
from dspark.core.outputs import output_lock
from dspark.data.prepare import PrepareConfig, prepare
from dspark.data.regenerate import RegenerateConfig, regenerate


def snapshot(folder: Path) -> dict:
    """Every file under `folder`, byte for byte."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prep(verifier, data, output, **kw):
    return prepare(PrepareConfig(model=str(verifier), data=str(data), output=str(output),
                                 **{"seq_length": 256, "minimum_valid_tokens": 8, **kw}), progress=False)


@pytest.fixture
def chats(tmp_path, chat_file) -> Path:
    return write_jsonl(tmp_path / "chats.jsonl", chat_file.read_text().splitlines()[:30])


# --- prepare ---------------------------------------------------------------------------------------------------

def test_prepare_never_replaces_a_folder_it_did_not_write(tmp_path, verifier, chats):
    unrelated = tmp_path / "v"
    (unrelated / "sub").mkdir(parents=True)
    (unrelated / "precious.txt").write_text("x")
    store = tmp_path / "store"  # a Zarr store: a folder of something else
    store.mkdir()
    (store / "manifest.json").write_text("{}")
    model = tmp_path / "m"
    shutil.copytree(verifier, model)
    before = {p: snapshot(p) for p in (unrelated, store, model)}
    proc = run_cli("prepare", "--model", verifier, "--data", chats, "--output", unrelated, "--seq-length", "512",
                   check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: --output {unrelated} exists and is not a folder `dspark prepare` wrote (prepare.json and its files, "
        "nothing else) (fix: give --output a new path)"]
    with pytest.raises(InputError, match=rf"--output {store} exists and is not a folder `dspark prepare` wrote"):
        prep(verifier, chats, store)
    with pytest.raises(InputError, match=rf"--output {model} is also --model"):
        prep(model, chats, model)
    inside = write_jsonl(model / "chats.jsonl", chats.read_text().splitlines())
    with pytest.raises(InputError, match=rf"--output {model} holds --data {inside}"):
        prep(verifier, inside, model)
    inside.unlink()
    assert {p: snapshot(p) for p in before} == before
    # Its own earlier output is rewritten (new settings) or found up to date; a new folder is created.
    out = tmp_path / "prepared"
    assert not prep(verifier, chats, out)["up_to_date"]
    assert prep(verifier, chats, out)["up_to_date"]
    assert not prep(verifier, chats, out, seq_length=128)["up_to_date"]
    assert not list(tmp_path.glob(".prepared*"))  # no lock file or temp folder left beside it


# --- holdout ---------------------------------------------------------------------------------------------------

def test_holdout_never_writes_over_an_input_or_one_output_over_another(tmp_path, chats):
    original = chats.read_bytes()
    cases = [(chats, tmp_path / "h.jsonl", [], rf"--train {chats} is also --data"),
             (tmp_path / "t.jsonl", chats, [], rf"--heldout-output {chats} is also --data"),
             (tmp_path / "same.jsonl", tmp_path / "same.jsonl", [], r"--train .*same.jsonl is also --heldout-output"),
             (tmp_path / "t.jsonl", tmp_path / "h.jsonl", [chats], rf"--exclude {chats} is also --data")]
    for train, held, exclude, message in cases:
        with pytest.raises(InputError, match=message):
            split(chats, train, held, heldout=3, seed=0, exclude=exclude)
    linked = tmp_path / "linked.jsonl"
    os.link(chats, linked)  # the same file under another name
    with pytest.raises(InputError, match=rf"--train {linked} is also --data"):
        split(chats, linked, tmp_path / "h.jsonl", heldout=3, seed=0)
    assert chats.read_bytes() == original and not (tmp_path / "t.jsonl").exists()
    proc = run_cli("holdout", "--data", chats, "--train", tmp_path / "same.jsonl", "--heldout-output",
                   tmp_path / "same.jsonl", "--heldout", "3", check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: --train {tmp_path / 'same.jsonl'} is also --heldout-output: one file cannot be both "
        "(fix: give --train a path of its own)"]


def test_holdout_rewrites_its_own_outputs_and_an_unrelated_file_only_with_force(tmp_path, chats):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    split(chats, train, held, heldout=3, seed=1)
    assert split(chats, train, held, heldout=4, seed=2)["heldout"] == 4  # its own earlier output
    held.write_text("mine\n")  # no longer what holdout wrote
    with pytest.raises(InputError, match=rf"--heldout-output {held} exists and is not a file `dspark holdout` wrote "
                                         r"\(recorded in train.jsonl.summary.json\) \(fix: .*--force"):
        split(chats, train, held, heldout=3, seed=0)
    assert held.read_text() == "mine\n"
    assert split(chats, train, held, heldout=3, seed=0, force=True)["heldout"] == 3
    with pytest.raises(InputError, match="is also --data"):  # --force never writes over an input
        split(chats, chats, held, heldout=3, seed=0, force=True)


# --- every command: a folder, a file or `.` where the other is expected -------------------------------------------

def test_an_output_path_of_the_wrong_kind_or_the_current_folder_is_one_line_before_any_work(tmp_path, verifier,
                                                                                             chats, monkeypatch):
    folder, file = tmp_path / "folder", tmp_path / "file.jsonl"
    folder.mkdir()
    file.write_text("x\n")
    monkeypatch.chdir(tmp_path)
    regen = dict(model=str(verifier), data=str(chats), max_prompts=1, max_new_tokens=2)
    runs = {"prepare": lambda out: prep(verifier, chats, out),
            "holdout": lambda out: split(chats, out, tmp_path / "h.jsonl", heldout=3, seed=0),
            "regenerate": lambda out: regenerate(RegenerateConfig(**regen, output=str(out)), progress=False)}
    for command, run in runs.items():
        wrong = file if command == "prepare" else folder
        kind = "folder" if command == "prepare" else "file"
        with pytest.raises(InputError, match=rf"{wrong} is a {'file' if kind == 'folder' else 'folder'}, not a {kind}"):
            run(wrong)
        for here in (Path("."), Path(".."), tmp_path):
            with pytest.raises(InputError, match=rf"{here} is the current folder or one above it"):
                run(here)
    assert snapshot(tmp_path) == {"file.jsonl": b"x\n", "chats.jsonl": chats.read_bytes()}


# --- verifier import -------------------------------------------------------------------------------------------

def test_verifier_import_force_keeps_unrelated_files_and_a_concurrent_import_is_refused(tmp_path):
    from test_verifier_import import write_gguf

    from dspark.verifier.importer import import_gguf

    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")  # a file of the same name as one the import writes: replaced
    with output_lock("--output", out):  # as a running import holds it
        proc = run_cli("verifier", "import", src, "--output", out, "--force", check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0].startswith(
        f"error: --output {out} is in use by pid {os.getpid()} on ") and len(proc.stderr.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    for where in (Path("."), src):
        proc = run_cli("verifier", "import", src, "--output", where, cwd=tmp_path, check=False)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = run_cli("verifier", "import", src, "--output", out, "--force", "--dtype", "float32", check=False)
    assert proc.returncode == 0, proc.stderr
    assert (out / "notes.txt").read_text() == "mine" and json.loads((out / "config.json").read_text())["hidden_size"]
    assert (out / "dspark_import.json").exists() and not list(tmp_path.glob(".out*"))
    rerun = run_cli("verifier", "import", src, "--output", out, "--dtype", "float32")
    assert "already imported" in rerun.stdout
    # --force over an earlier import replaces all of its files (a stale shard would load as its weights)
    record = json.loads((out / "dspark_import.json").read_text())
    (out / "model-00001-of-00002.safetensors").write_text("an earlier import's shard")
    (out / "dspark_import.json").write_text(json.dumps({**record, "files": [*record["files"],
                                                                            "model-00001-of-00002.safetensors"]}))
    assert import_gguf(str(src), out, dtype="bfloat16", force=True)["status"] == "imported"
    assert not (out / "model-00001-of-00002.safetensors").exists() and (out / "notes.txt").read_text() == "mine"


# --- regenerate: a full disk -------------------------------------------------------------------------------------

def test_regenerate_on_a_full_disk_is_one_line_and_loses_nothing(tmp_path, tiny_fs, verifier, chats):
    base = dict(model=str(verifier), data=str(chats), max_new_tokens=8, batch_size=2, dtype="float32")
    out = tiny_fs / "regen.jsonl"
    regenerate(RegenerateConfig(**base, output=str(out), max_prompts=2), progress=False)
    before = {p.name: p.read_bytes() for p in tiny_fs.iterdir()}
    filler = tiny_fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # until the disk is full
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(InputError, match=rf"cannot write {out}: the disk is full .*the prompts committed before are "
                                         "kept: rerun the same command to resume"):
        regenerate(RegenerateConfig(**base, output=str(out), max_prompts=6), progress=False)
    record = out.with_name("regen.jsonl.regenerate.json")
    assert record.read_bytes() == before[record.name] and out.read_bytes().startswith(before[out.name])
    filler.unlink()
    regenerate(RegenerateConfig(**base, output=str(out), max_prompts=6), progress=False)
    regenerate(RegenerateConfig(**base, output=str(tmp_path / "whole.jsonl"), max_prompts=6), progress=False)
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()  # as if the disk had never filled


# --- extract: two creators of one new store with two codecs ------------------------------------------------------

def test_an_extract_whose_new_store_a_concurrent_extract_created_with_another_codec_is_refused(tmp_path, verifier,
                                                                                                prepared, monkeypatch):
    import dspark.extract.runner as runner
    from dspark.connector.config import SinkConfig, ZarrConfig
    from dspark.connector.manifest import manifest_for_model
    from dspark.extract.config import ExtractConfig
    from dspark.data.prepare import PreparedData

    store = tmp_path / "store"
    real = runner.open_engine

    def the_other_extract_creates_it_first(*a, **kw):  # between this one's check and its sink's creation
        engine = real(*a, **kw)
        manifest_for_model(Verifier.resolve(verifier), LAYERS, PreparedData(prepared).fingerprint, encoding="raw",
                           dtype=engine.dtype_name,
                           codec="lz4").create_or_match(store)
        return engine

    monkeypatch.setattr(runner, "open_engine", the_other_extract_creates_it_first)
    with pytest.raises(InputError, match=rf"store {store} was created with codec lz4, not zstd"):
        runner.run_extract(ExtractConfig(model=str(verifier), data=str(prepared), target_layer_ids=LAYERS,
                                         sink=SinkConfig(zarr=ZarrConfig(store=str(store), codec="zstd")),
                                         batch_tokens=1024),
                           progress=False)
    assert not list((store / "segments").glob("*/index.bin"))  # it wrote nothing in the other codec
