"""`pytest --clear-test-cache` removes what the tests cached across sessions, and nothing else."""

from __future__ import annotations

from pack_helpers import clear_test_cache


def test_clearing_removes_the_tests_entries_and_keeps_the_users_files(tmp_path):
    cache = tmp_path / "cache"
    for name in ("tiny-0123456789abcdef", ".tiny-scratch", "sglang-0.5.23", "hypothesis"):
        (cache / name / "inner").mkdir(parents=True)
        (cache / name / "inner" / "file").write_bytes(b"x")
    (cache / "notes.txt").write_text("the user's own")
    clear_test_cache(cache)
    assert sorted(path.name for path in cache.iterdir()) == ["notes.txt"]
    (cache / "notes.txt").unlink()
    (cache / "tiny-fedcba9876543210").mkdir()
    clear_test_cache(cache)
    assert not cache.exists()
    clear_test_cache(cache)  # nothing there: nothing to do
