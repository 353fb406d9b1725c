"""Load the real vLLM 0.33 Python modules on a CPU, with only their heavy imports stubbed.

The vLLM wheel is a test dependency, fetched only when asked: with SINKATTN_FETCH_VLLM=1 (.ci/run sets it)
`vllm_root()` downloads it once (`pip download vllm==0.33.0 --no-deps`, 336 MB, into SINKATTN_CACHE or
~/.cache/sinkattn), saying so first, and unpacks its .py files next to it; without it and without the wheel in
that cache, the vLLM tests skip and say how to fetch it. Nothing from it enters the project.

`install(root)` puts a finder first on sys.meta_path that serves every `vllm.*` module:
  - the packages in HOLLOW are served from their directory without running their __init__.py (those
    inits import the engine, CUDA ops, torch.distributed setup, pydantic configs, ...);
  - the modules named in STUBS get a small stand-in (below, each says what it replaces and why);
  - every other module is the wheel's own source, executed unchanged.
So the code the tests drive (attention backend base classes and registry, CommonAttentionMetadata, KV cache
specs and layouts, the selector's config, the CUDA platform's backend selection) is vLLM's; only plumbing is
faked. (vllm/v1/attention/backends/utils.py and the vLLM backends themselves pull in the engine, configs
and zmq, so they are not loaded: selection records them as unavailable, which is all the tests need.)
`park()` takes the finder and every vllm module out again (tests that use them install and park around
themselves), keeping the module objects for the next `install()`.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

try:
    from cache_lock import cache_lock
except ImportError:  # imported as tests.<this module> (a child process with the repository, not tests/, on its path)
    from tests.cache_lock import cache_lock

VLLM_VERSION = "0.33.0"
WHEEL_SIZE = "336 MB"  # vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl: 336,361,138 bytes
FETCH_ENV = "SINKATTN_FETCH_VLLM"


class NotFetched(RuntimeError):
    """The wheel is not in the cache and fetching it was not asked for (FETCH_ENV)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SINKATTN_CACHE", Path.home() / ".cache" / "sinkattn"))


def fetch_hint() -> str:
    return (f"the vLLM tests need the vllm {VLLM_VERSION} wheel ({WHEEL_SIZE}, no dependencies), not in "
            f"{cache_dir() / f'vllm-{VLLM_VERSION}'}; fetch it once with {FETCH_ENV}=1 (or put the wheel there, or "
            "point SINKATTN_CACHE at a folder that holds it)")


def vllm_root(fetch: bool | None = None, announce=None) -> Path:
    """The unpacked vllm/ source tree of the 0.33 wheel, downloading the wheel if needed and allowed
    (`fetch`, default: FETCH_ENV=1); `announce(line)` is told before a download starts.
    Raises NotFetched when the wheel is missing and not to be fetched, RuntimeError (with pip's message)
    when it cannot be fetched."""
    base = cache_dir() / f"vllm-{VLLM_VERSION}"
    src = base / "src"
    if (src / "vllm" / "v1" / "attention" / "backend.py").exists():
        return src
    with cache_lock(base):
        return _fetch_and_unpack(base, src, fetch, announce)


def _fetch_and_unpack(base: Path, src: Path, fetch, announce) -> Path:
    if (src / "vllm" / "v1" / "attention" / "backend.py").exists():  # another worker did it while we waited
        return src
    wheels = sorted(base.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        if not (os.environ.get(FETCH_ENV) == "1" if fetch is None else fetch):
            raise NotFetched(fetch_hint())
        base.mkdir(parents=True, exist_ok=True)
        (announce or (lambda line: print(line, file=sys.stderr, flush=True)))(
            f"sinkattn tests: downloading the vllm {VLLM_VERSION} wheel ({WHEEL_SIZE}, once) into {base} "
            f"({FETCH_ENV}=1; unset it to skip the vLLM tests instead)")
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
                            "--only-binary=:all:", "-d", str(base), "-q"], capture_output=True, text=True)
        wheels = sorted(base.glob(f"vllm-{VLLM_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download vllm=={VLLM_VERSION} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    tmp = base / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a run interrupted while unpacking
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    tmp.rename(src)
    return src


def run_interpreted(module: str, child: str, tmp_path, timeout: int = 600) -> str:
    """Runs `module.child(src)` in a process with TRITON_INTERPRET=1, src being vLLM's peer files extracted from the
    wheel into tmp_path (bench/harness/peer_vllm.py) -> its stdout. Skips without the wheel; fails with the child's
    output when it fails."""
    import pytest
    from bench.harness import peer_vllm
    if not sorted((cache_dir() / f"vllm-{VLLM_VERSION}").glob("vllm-*.whl")):  # extract would fetch it
        pytest.skip(fetch_hint())
    root = Path(__file__).resolve().parent.parent
    src = peer_vllm.extract(tmp_path / "peer")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")]))
    code = f"from {module} import {child}; {child}({str(src)!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


# ---- stand-ins ------------------------------------------------------------------------------------------
def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


class _Anything:
    """A value any attribute or call of which is another _Anything (for names only used in annotations or
    in code paths the tests do not take)."""

    def __init__(self, name="stub"):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *a, **k):
        return _Anything(f"{self._name}()")

    def __repr__(self):
        return f"<stub {self._name}>"


class Parallel:
    """What AttentionImplBase.__new__ asks vllm.distributed about; tests set dcp_world_size."""
    dcp_world_size = 1


def _parallel_state():
    def get_pcp_group():
        raise AssertionError("no PCP group (stub)")  # what vLLM raises when the group is not initialised
    return _module("vllm.distributed.parallel_state",
                   get_dcp_world_size_and_rank=lambda *a, **k: (Parallel.dcp_world_size, 0),
                   get_pcp_group=get_pcp_group, is_global_first_rank=lambda: True,
                   is_local_first_rank=lambda: True)


def _config():
    # vllm.config is pydantic models (not installed here). The selection code reads a few fields; tests pass
    # their own config object to builders, and AttentionImplBase.__new__ only asks for "no current config".
    return _module("vllm.config", __path__=[], get_current_vllm_config_or_none=lambda: None,
                   CUDAGraphMode=_Anything("CUDAGraphMode"), VllmConfig=object, CacheConfig=object,
                   get_layers_from_vllm_config=lambda *a, **k: {})


def _config_cache():
    # vllm/config/cache.py is a pydantic model; selector.py takes three names from it.
    dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    return _module("vllm.config.cache", KV_CACHE_DTYPES=dtypes, CacheDType=str,
                   is_known_kv_cache_dtype=lambda d: True)


def _quant_utils():
    # backend.py imports four QuantKey constants, used only by MLA impls' fused output quantisation.
    names = ("kFp8Dynamic64Sym", "kFp8Dynamic128Sym", "kFp8StaticTensorSym", "kNvfp4Dynamic")
    return _module("vllm.model_executor.layers.quantization.utils.quant_utils",
                   QuantKey=object, **{n: _Anything(n) for n in names})


class Platform:
    """The GPU the selection code sees; tests set capability. vLLM's real CudaPlatform serves every question
    but the ones that would ask a driver (capability, name)."""
    capability = (8, 0)


def _platforms():
    # vllm/platforms/__init__.py detects the platform by probing drivers and plugins; this package keeps its
    # directory (cuda.py, interface.py load unchanged) and resolves current_platform to vLLM's CudaPlatform
    # with the device questions answered from Platform.
    m = _module("vllm.platforms")
    m.__path__ = [str(_finder.root / "vllm" / "platforms")]

    def __getattr__(name):
        if name != "current_platform":
            raise AttributeError(name)
        from vllm.platforms.cuda import CudaPlatform
        from vllm.platforms.interface import DeviceCapability

        class FakeCuda(CudaPlatform):
            @classmethod
            def get_device_capability(cls, device_id=0):
                return DeviceCapability(*Platform.capability)

            @classmethod
            def has_device_capability(cls, capability, device_id=0):
                cap = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
                return Platform.capability[0] * 10 + Platform.capability[1] >= cap

            @classmethod
            def get_device_name(cls, device_id=0):
                return f"fake GPU cc {Platform.capability[0]}.{Platform.capability[1]}"

            @classmethod
            def is_pin_memory_available(cls):
                return False

        m.current_platform = FakeCuda()
        return m.current_platform

    m.__getattr__ = __getattr__
    return m


STUBS = {
    "vllm.platforms": _platforms,
    "vllm.distributed.parallel_state": _parallel_state,
    "vllm.config": _config,
    "vllm.config.cache": _config_cache,
    "vllm.model_executor.layers.quantization.utils.quant_utils": _quant_utils,
    # compiled extension of the CUDA platform module (loads libtorch CUDA kernels)
    "vllm._C_stable_libtorch": lambda: _module("vllm._C_stable_libtorch"),
}


# Packages whose __init__.py is not run (their directory still serves submodules): each pulls in the engine.
HOLLOW = {"vllm", "vllm.model_executor", "vllm.distributed", "vllm.model_executor.layers",
          "vllm.model_executor.layers.quantization"}


class _Loader(importlib.abc.Loader):
    def __init__(self, make=None, path=None):
        self.make, self.path = make, path

    def create_module(self, spec):
        return self.make() if self.make else None

    def exec_module(self, module):
        if self.path is not None:  # hollow package: submodules resolve in the real directory
            module.__path__ = [str(self.path)]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in STUBS:
            return importlib.machinery.ModuleSpec(name, _Loader(make=STUBS[name]))
        d = self.root.joinpath(*name.split("."))
        if d.is_dir() and name in HOLLOW:
            return importlib.machinery.ModuleSpec(name, _Loader(path=d), is_package=True)
        if d.is_dir():
            return importlib.util.spec_from_file_location(name, d / "__init__.py",
                                                          submodule_search_locations=[str(d)])
        f = d.with_suffix(".py")
        if f.is_file():
            return importlib.util.spec_from_file_location(name, f)
        return None


_finder: _Finder | None = None
_parked: dict[str, types.ModuleType] = {}


def _ours(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.") or name == "sinkattn.integrations.vllm_backend"


def install(root: Path) -> None:
    """Make vLLM's modules importable (again). vLLM's modules can be executed only once per process
    (vllm.utils.torch_utils registers torch opaque types at import, and torch refuses a second
    registration), so `park()` sets them aside and this puts the same module objects back."""
    global _finder
    if _finder is None or _finder.root != Path(root):
        if _finder is not None:
            raise RuntimeError(f"vLLM's modules were loaded from {_finder.root}; one source per process")
        _finder = _Finder(Path(root))
        logging.getLogger("vllm").setLevel(logging.WARNING)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    sys.modules.update(_parked)
    _parked.clear()


def park() -> None:
    """Take vLLM (and sinkattn's backend module, built on it) out of sys.modules and the finder off
    sys.meta_path, so that tests after this one see no vllm; `install()` brings the same modules back."""
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if _ours(n)]:
        _parked[name] = sys.modules.pop(name)
