"""flash-attn 2.8.3's own test suite, fetched at test time, run against sinkattn.flash_attn_interface.

Nothing of flash-attn enters the project: with SINKATTN_FETCH_FLASH_ATTN=1 (CI sets it) `suite_root()` downloads
flash-attn's source distribution once (`pip download flash-attn==2.8.3 --no-deps --no-binary :all:`, 8.4 MB)
and einops (the suite's one import besides torch and pytest; a pure-Python wheel) into SINKATTN_CACHE or
~/.cache/sinkattn/flash-attn-2.8.3, and unpacks from the sdist only what the suite reads:
    tests/test_flash_attn.py        the suite, unchanged
    flash_attn/bert_padding.py      its padding helpers (pure PyTorch), unchanged
Without the variable and without those files in the cache, `suite_root()` raises NotFetched (the test that
runs the suite skips, saying how to fetch it).

`run(...)` runs the suite in a subprocess under tests/flash_attn_adapter.py (a pytest plugin: the conftest of
the fetched suite), which redirects flash-attn's imports to the drop-in, CUDA to the CPU, and samples the
parametrization (see that file).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

try:
    from cache_lock import cache_lock
except ImportError:  # imported as tests.<this module> (a child process with the repository, not tests/, on its path)
    from tests.cache_lock import cache_lock

FA_VERSION = "2.8.3"
EINOPS_VERSION = "0.8.2"
FETCH_ENV = "SINKATTN_FETCH_FLASH_ATTN"
HERE = Path(__file__).resolve().parent
ADAPTER = HERE / "flash_attn_adapter.py"
# The files of the sdist the suite needs (paths inside flash_attn-2.8.3/).
MEMBERS = ("tests/test_flash_attn.py", "flash_attn/bert_padding.py")


class NotFetched(RuntimeError):
    """The suite is not in the cache and fetching it was not asked for (FETCH_ENV)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SINKATTN_CACHE", Path.home() / ".cache" / "sinkattn")) / f"flash-attn-{FA_VERSION}"


def fetch_hint() -> str:
    return (f"flash-attn {FA_VERSION}'s own test suite is not in {cache_dir()}; fetch it once (its 8.4 MB source "
            f"distribution and einops, no install) with {FETCH_ENV}=1, or point SINKATTN_CACHE at a folder that "
            f"holds it")


def _pip(*args: str) -> None:
    # FLASH_ATTENTION_SKIP_CUDA_BUILD: pip reads the sdist's metadata by running its setup.py, which otherwise
    # looks for nvcc; --no-build-isolation lets that setup.py import the torch already installed.
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
    r = subprocess.run([sys.executable, "-m", "pip", *args, "-q"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed: {(r.stderr or r.stdout).strip()[-600:]}")


def suite_root(fetch: bool | None = None, announce=None) -> Path:
    """The folder that holds flash-attn's tests/ and flash_attn/bert_padding.py, and site/ (einops); fetched
    if missing and allowed (`fetch`, default: FETCH_ENV=1)."""
    base = cache_dir()
    src = base / "src"
    if all((src / m).exists() for m in MEMBERS) and (base / "site" / "einops").is_dir():
        return base
    with cache_lock(base):
        return _fetch_and_unpack(base, src, fetch, announce)


def _fetch_and_unpack(base: Path, src: Path, fetch, announce) -> Path:
    if all((src / m).exists() for m in MEMBERS) and (base / "site" / "einops").is_dir():  # done while we waited
        return base
    if not (os.environ.get(FETCH_ENV) == "1" if fetch is None else fetch):
        raise NotFetched(fetch_hint())
    base.mkdir(parents=True, exist_ok=True)
    (announce or (lambda line: print(line, file=sys.stderr, flush=True)))(
        f"sinkattn tests: downloading flash-attn {FA_VERSION}'s source distribution (8.4 MB) and einops "
        f"{EINOPS_VERSION} once into {base} ({FETCH_ENV}=1; unset it to skip flash-attn's suite instead)")
    dl = base / "downloads"
    sdists = sorted(dl.glob(f"flash_attn-{FA_VERSION}.tar.gz"))
    if not sdists:
        _pip("download", f"flash-attn=={FA_VERSION}", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             "-d", str(dl))
        sdists = sorted(dl.glob(f"flash_attn-{FA_VERSION}.tar.gz"))
    wheels = sorted(dl.glob(f"einops-{EINOPS_VERSION}-*.whl"))
    if not wheels:
        _pip("download", f"einops=={EINOPS_VERSION}", "--no-deps", "--only-binary=:all:", "-d", str(dl))
        wheels = sorted(dl.glob(f"einops-{EINOPS_VERSION}-*.whl"))
    if not sdists or not wheels:
        raise RuntimeError(f"pip download left no flash-attn {FA_VERSION} sdist or einops wheel in {dl}")
    tmp = base / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a run interrupted while unpacking
    prefix = f"flash_attn-{FA_VERSION}/"
    with tarfile.open(sdists[0]) as t:
        for m in MEMBERS:
            member = t.getmember(prefix + m)
            dest = tmp / m
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(t.extractfile(member).read())
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    site = base / "site"
    shutil.rmtree(site, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(site, [n for n in z.namelist() if n.startswith("einops/")])
    return base


def run(root: Path, report: Path, *pytest_args: str, sample: str | None = None, max_area: str | None = None,
        skip: str | None = None, timeout: float = 1800):
    """Run the suite under the adapter; -> (returncode, output, report {"cases": [{nodeid, outcome, reason}],
    "left_out": {"test argnames": [values above max_area]}})."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(root / "site"), str(HERE.parent),
                                          env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["SINKATTN_FA_SUITE_ROOT"] = str(root / "src")
    env["SINKATTN_FA_REPORT"] = str(report)
    if sample is not None:
        env["SINKATTN_FA_SAMPLE"] = sample
    if max_area is not None:
        env["SINKATTN_FA_MAX_AREA"] = max_area
    if skip is not None:
        env["SINKATTN_FA_SKIP"] = skip
    cmd = [sys.executable, "-m", "pytest", "-p", "flash_attn_adapter", "-p", "no:cacheprovider", "-q",
           "-c", os.devnull, "--rootdir", str(root / "src"), str(root / "src" / "tests" / "test_flash_attn.py"),
           *pytest_args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(root / "src"), timeout=timeout)
    entries = json.loads(report.read_text()) if report.exists() else {"cases": [], "left_out": {}}
    return r.returncode, r.stdout + r.stderr, entries
