"""The test cache's fetch-and-unpack under its lock (tests/cache_lock.py): workers that find flash-attn's suite
missing at the same moment unpack it one after the other and all get the unpacked tree."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

import flash_attn_upstream as fa


def test_two_workers_unpack_flash_attns_suite_once(tmp_path, monkeypatch):
    have = fa.cache_dir() / "downloads"
    if not list(have.glob(f"flash_attn-{fa.FA_VERSION}.tar.gz")) or not list(have.glob("einops-*.whl")):
        pytest.skip(fa.fetch_hint())
    monkeypatch.setenv("SINKATTN_CACHE", str(tmp_path))
    shutil.copytree(have, fa.cache_dir() / "downloads")  # the downloads without their unpacked tree
    unpacks, results, errors = [], [], []
    real = fa.tarfile.open

    def counting_open(*a, **kw):
        unpacks.append(threading.get_ident())
        return real(*a, **kw)
    monkeypatch.setattr(fa.tarfile, "open", counting_open)

    def worker():
        try:
            results.append(fa.suite_root(fetch=True, announce=lambda line: None))  # downloads present: no pip
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(unpacks) == 1, (errors, unpacks)
    assert results == [fa.cache_dir()] * 4 and all((fa.cache_dir() / "src" / m).exists() for m in fa.MEMBERS)
    assert Path(fa.cache_dir() / ".lock").exists()
