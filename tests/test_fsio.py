"""dspark.core.fsio: a reader sees the old file (folder, link) or the new one, never half; and the data is fsynced first."""

import os
from pathlib import Path

import pytest

from dspark.core import fsio
from dspark.core.fsio import (copy_atomic, is_temp, publishing, remove_leftovers, replace_symlink, replacing, temp_path,
                         write_atomic, write_new)


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temp(p.name))


@pytest.fixture
def fsyncs(monkeypatch) -> list[str]:
    """The path of every fd fsynced, in order (os.fsync still runs)."""
    seen, real = [], os.fsync

    def record(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def test_text_and_bytes_are_written_whole_and_replace_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_atomic(path, "old")
    write_atomic(path, "grüße\n")
    assert path.read_bytes() == "grüße\n".encode()
    write_atomic(path, b"\x00\xff" * 100_000)
    assert path.read_bytes() == b"\x00\xff" * 100_000
    copy_atomic(path, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == path.read_bytes()
    assert temps(tmp_path) == []


def test_an_exception_inside_replacing_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text("old")
    with pytest.raises(KeyError, match="half-way"):
        with replacing(path) as f:
            f.write(b"new, but only par")
            raise KeyError("half-way")
    assert path.read_text() == "old"
    assert temps(tmp_path) == []


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    path = tmp_path / "out.md"
    path.symlink_to(victim)
    write_atomic(path, "report")
    assert not path.is_symlink() and path.read_text() == "report"
    assert victim.read_text() == "keep me"
    (tmp_path / "copied").symlink_to(victim)
    copy_atomic(path, tmp_path / "copied")
    assert victim.read_text() == "keep me" and not (tmp_path / "copied").is_symlink()


def test_replace_symlink_moves_the_link_never_what_it_points_at(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    latest = tmp_path / "latest"
    replace_symlink(latest, "a")
    replace_symlink(latest, "b")
    assert os.readlink(latest) == "b" and (tmp_path / "a").is_dir() and list((tmp_path / "a").iterdir()) == []
    assert temps(tmp_path) == []


def test_write_new_creates_once_and_a_second_creator_loses(tmp_path):
    path = tmp_path / "manifest.json"
    assert write_new(path, "first") is True
    assert write_new(path, "second") is False
    assert path.read_text() == "first" and temps(tmp_path) == []


def test_a_published_folder_appears_whole_under_its_name(tmp_path):
    final = tmp_path / "step-000010"
    with publishing(final) as tmp:
        assert is_temp(tmp.name) and tmp.parent == tmp_path and not final.exists()
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
    assert (final / "sub" / "w.bin").read_bytes() == b"w" and (final / "config.json").read_text() == "{}"
    assert temps(tmp_path) == []


def test_a_folder_that_fails_mid_way_is_removed_and_never_published(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        with publishing(final) as tmp:
            (tmp / "input_ids.npy").write_bytes(b"half")
            raise OSError("disk full")
    assert not final.exists() and temps(tmp_path) == []


def test_publishing_never_replaces_a_folder_unless_asked(tmp_path):
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "model.safetensors").write_text("old")
    with pytest.raises(OSError):  # ENOTEMPTY: an existing checkpoint stays
        with publishing(final) as tmp:
            (tmp / "model.safetensors").write_text("new")
    assert (final / "model.safetensors").read_text() == "old" and temps(tmp_path) == []
    with publishing(final, replace=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]
    assert (final / "model.safetensors").read_text() == "new" and temps(tmp_path) == []


def test_publishing_replaces_a_symlink_without_touching_its_target_and_refuses_a_file(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("keep")
    link = tmp_path / "prepared"
    link.symlink_to(elsewhere)
    with publishing(link, replace=True) as tmp:
        (tmp / "prepare.json").write_text("{}")
    assert not link.is_symlink() and [p.name for p in link.iterdir()] == ["prepare.json"]
    assert [p.name for p in elsewhere.iterdir()] == ["mine.txt"]
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(NotADirectoryError):
        with publishing(a_file, replace=True) as tmp:
            (tmp / "prepare.json").write_text("{}")
    assert a_file.read_text() == "mine" and temps(tmp_path) == []


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, fsyncs, monkeypatch):
    path = tmp_path / "record.json"
    renamed_after = []
    real_replace = os.replace

    def replace(src, dst):
        renamed_after.append(len(fsyncs))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    write_atomic(path, "{}")
    assert len(fsyncs) == 2 and is_temp(Path(fsyncs[0]).name) and Path(fsyncs[0]).parent == tmp_path
    assert renamed_after == [1] and fsyncs[1] == str(tmp_path)


def test_a_published_folder_has_every_file_and_folder_fsynced_then_its_parent(tmp_path, fsyncs):
    final = tmp_path / "ckpt"
    with publishing(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a").write_text("a")
        (tmp / "b").write_text("b")
        (tmp / "link").symlink_to("b")
    names = [p.replace(str(tmp), "TMP") for p in fsyncs]
    assert sorted(names[:4]) == sorted(["TMP/sub/a", "TMP/sub", "TMP/b", "TMP"]) and names[3] == "TMP"
    assert names[4:] == [str(tmp_path)]


def test_symlink_and_exclusive_writes_fsync_the_folder(tmp_path, fsyncs):
    replace_symlink(tmp_path / "latest", "x")
    assert fsyncs == [str(tmp_path)]
    write_new(tmp_path / "m", "{}")
    assert is_temp(Path(fsyncs[1]).name) and fsyncs[2:] == [str(tmp_path)]


def test_durable_false_keeps_the_rename_and_skips_every_fsync(tmp_path, fsyncs):
    write_atomic(tmp_path / "chunk", b"x", durable=False)
    assert (tmp_path / "chunk").read_bytes() == b"x" and fsyncs == [] and temps(tmp_path) == []


def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    path = tmp_path / "out"
    dead = tmp_path / ".out.999999999-0badcafe.tmp"
    dead.mkdir()
    (dead / "w").write_text("w")
    live = temp_path(path)  # this process's: a write in progress
    live.write_text("x")
    other = temp_path(tmp_path / "out.summary.json")  # another file's temp, however dead its writer
    other.write_text("x")
    assert remove_leftovers(path) == [dead] and live.exists() and other.exists()
    assert remove_leftovers(path, sole_writer=True) == [live] and other.exists()


def test_a_folder_that_cannot_be_synced_is_no_error(tmp_path, monkeypatch):
    def einval(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "fsync", einval)
    fsio.fsync_dir(tmp_path)
