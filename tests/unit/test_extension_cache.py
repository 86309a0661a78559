"""The C++ extension's build cache: a lock left by a killed build must not hang the next one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tokenmill.csrc import STALE_LOCK_S, _remove_stale_lock


def test_stale_lock_removed_fresh_lock_kept(tmp_path: Path) -> None:
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    _remove_stale_lock(str(stale))
    _remove_stale_lock(str(fresh))  # a build may be running right now: wait for it
    _remove_stale_lock(str(tmp_path / "missing"))
    assert not stale.exists() and fresh.exists()
