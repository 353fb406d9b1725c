"""Loading of the compiled extension sinkattn._C.

A failing import is recorded with its cause, never swallowed: the report shows it and every request for
a kernel raises an error that carries it. The pure-Python parts (reference backend, report) keep working.
"""
from __future__ import annotations

import functools

from .errors import SinkattnRuntimeError

_C = None
IMPORT_ERROR: str | None = None

import importlib.util

if importlib.util.find_spec(__package__ + "._C") is None:
    IMPORT_ERROR = ("this is a pure-Python build: sinkattn._C was not compiled (SINKATTN_SKIP_CUDA=1, or no nvcc "
                    "was found at build time)")
else:
    try:
        from . import _C  # noqa: F811
    except ImportError as e:  # a compiled extension that does not load (ABI, missing libraries, ...)
        IMPORT_ERROR = f"{type(e).__name__}: {e}"


def loaded() -> bool:
    return _C is not None


def require():
    """The extension module, or an error saying why it is not there."""
    if _C is None:
        raise SinkattnRuntimeError(
            "sinkattn's compiled extension (sinkattn._C) is not available: "
            f"{IMPORT_ERROR}. Build it with `pip install --no-build-isolation .` on a machine with nvcc, or use "
            "backend='reference'. `python -m sinkattn.report` says more.")
    return _C


@functools.lru_cache(maxsize=1)
def registry() -> tuple[dict, ...]:
    """The kernels compiled into the binary (empty without the extension)."""
    return tuple(_C.registry()) if _C is not None else ()


@functools.lru_cache(maxsize=1)
def build_info() -> dict | None:
    return dict(_C.build_info()) if _C is not None else None
