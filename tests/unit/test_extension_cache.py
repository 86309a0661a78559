"""The C++ extension's build cache (a lock left by a killed build must not hang the next one),
and the process-wide settings made when it loads (weights streamed past the caches)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tokenmill.kernels.cpu import STALE_LOCK_S, _remove_stale_lock


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


def _fake_caches(root, *levels: tuple[int, str, str]):
    for i, (level, kind, size) in enumerate(levels):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_last_level_cache_from_sysfs(tmp_path) -> None:
    from tokenmill.kernels.cpu import last_level_cache_bytes

    zen = _fake_caches(tmp_path / "zen", (1, "Data", "48K"), (1, "Instruction", "32K"),
                       (2, "Unified", "1024K"), (3, "Unified", "32768K"))
    assert last_level_cache_bytes(zen) == 32 << 20
    # No L3 (some ARM cores): the L2 is the last level; an instruction cache never counts.
    arm = _fake_caches(tmp_path / "arm", (1, "Data", "64K"), (2, "Unified", "2M"),
                       (4, "Instruction", "9G"))
    assert last_level_cache_bytes(arm) == 2 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_weights_stream_past_the_cache_only_for_models_larger_than_it(monkeypatch) -> None:
    import tokenmill.kernels.cpu as csrc

    ext = csrc.load_extension()
    was = ext.stream_weights()
    monkeypatch.setattr(csrc, "_model_weight_bytes", 0)
    monkeypatch.setattr(csrc, "_stream_weights", was)
    monkeypatch.setattr(csrc, "last_level_cache_bytes", lambda: 32 << 20)
    monkeypatch.setattr(csrc, "cpu_vendor", lambda: "AuthenticAMD")
    try:
        assert csrc.note_model_weights(8 << 20) is False and not ext.stream_weights()
        # A second model: the process's models together no longer fit.
        assert csrc.note_model_weights(30 << 20) is True and ext.stream_weights()
        assert csrc.note_model_weights(0, stream=False) is False and not ext.stream_weights()
        monkeypatch.setattr(csrc, "_model_weight_bytes", 0)
        assert csrc.note_model_weights(1, stream=True) is True and ext.stream_weights()
    finally:
        ext.set_stream_weights(was)


def test_a_models_bytes_leave_when_the_model_goes(monkeypatch) -> None:
    """A multi-model server unloads models: once a large one is collected, a small one left
    alone fits the cache again."""
    import gc

    import tokenmill.kernels.cpu as csrc

    ext = csrc.load_extension()
    was = ext.stream_weights()
    monkeypatch.setattr(csrc, "_model_weight_bytes", 0)
    monkeypatch.setattr(csrc, "_stream_weights", was)
    monkeypatch.setattr(csrc, "last_level_cache_bytes", lambda: 32 << 20)
    monkeypatch.setattr(csrc, "cpu_vendor", lambda: "AuthenticAMD")

    class Model:
        pass

    small, large = Model(), Model()
    try:
        assert csrc.note_model_weights(8 << 20, owner=small) is False
        assert csrc.note_model_weights(64 << 20, owner=large) is True and ext.stream_weights()
        del large
        gc.collect()
        assert csrc._model_weight_bytes == 8 << 20
        assert not ext.stream_weights() and csrc._stream_weights is False
        del small
        gc.collect()
        assert csrc._model_weight_bytes == 0
    finally:
        ext.set_stream_weights(was)



def test_weights_stream_only_on_cpus_where_that_helps(monkeypatch) -> None:
    """An Intel Xeon read prefetchnta'd weights ~2.5x slower than normally fetched ones: there
    (and on CPUs nobody measured) a model larger than the cache is fetched normally, unless
    told otherwise."""
    import tokenmill.kernels.cpu as csrc

    ext = csrc.load_extension()
    was = ext.stream_weights()
    monkeypatch.setattr(csrc, "_model_weight_bytes", 0)
    monkeypatch.setattr(csrc, "_stream_weights", was)
    monkeypatch.setattr(csrc, "last_level_cache_bytes", lambda: 32 << 20)
    try:
        for vendor in ("GenuineIntel", ""):
            monkeypatch.setattr(csrc, "cpu_vendor", lambda v=vendor: v)
            monkeypatch.setattr(csrc, "_model_weight_bytes", 0)
            assert csrc.note_model_weights(64 << 20) is False and not ext.stream_weights()
            assert csrc.note_model_weights(0, stream=True) is True and ext.stream_weights()
        monkeypatch.setattr(csrc, "cpu_vendor", lambda: "AuthenticAMD")
        assert csrc.note_model_weights(0) is True and ext.stream_weights()
    finally:
        ext.set_stream_weights(was)


def test_cpu_vendor_reads_cpuinfo() -> None:
    import os

    from tokenmill.kernels.cpu import cpu_vendor

    vendor = cpu_vendor()
    if not os.path.exists("/proc/cpuinfo"):
        assert vendor == ""
        return
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        named = [line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")]
    assert vendor == (named[0] if named else "")
