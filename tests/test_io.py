"""Atomic writes: a failed write leaves nothing behind, and what lands has the mode a plain create gives
(mkstemp/mkdtemp alone would leave exports and data readable by their owner only)."""

import os
import stat

import pytest

from specdistill.io import CorruptFile, atomic_dir, verify_checksums, write_checksums, write_json


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_files_and_dirs_land_with_the_umask_mode(tmp_path, umask_022):
    write_json(tmp_path / "summary.json", {"a": 1})
    with atomic_dir(tmp_path / "export") as tmp:
        (tmp / "config.json").write_text("{}")
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755
    assert (tmp_path / "export" / "config.json").read_text() == "{}"


def test_a_failed_write_leaves_the_old_content_and_no_temp_files(tmp_path):
    write_json(tmp_path / "summary.json", {"old": True})
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "summary.json.d"):
        raise RuntimeError("killed")
    with pytest.raises(TypeError):
        write_json(tmp_path / "summary.json", {"bad": object()})
    assert (tmp_path / "summary.json").read_text() == '{\n  "old": true\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_checksums_name_the_changed_missing_or_unreadable_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.json").write_text("{}")
    write_checksums(tmp_path)
    verify_checksums(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"abd")
    with pytest.raises(CorruptFile, match=r"a.bin: sha256 .* checksums.json records"):
        verify_checksums(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.json").unlink()
    with pytest.raises(CorruptFile, match=r"sub/b.json: missing"):
        verify_checksums(tmp_path)
    (tmp_path / "checksums.json").write_bytes(b"\xff{")
    with pytest.raises(CorruptFile, match=r"checksums.json: unreadable"):
        verify_checksums(tmp_path)
