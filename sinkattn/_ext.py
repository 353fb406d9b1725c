"""Loading of the compiled extension sinkattn._C.

A failing import is recorded with its cause, never swallowed: the report shows it and every request for
a kernel raises an error that carries it. The pure-Python parts (reference backend, report) keep working.

A package without `_C` is not always a pure-Python build: run from a clone after a non-editable
`pip install .`, Python puts the current directory first on sys.path, so the clone's `sinkattn/` (whose
extension was built into the installed copy, not beside these sources) hides the installed build.
`shadowed()` finds the copies hidden behind the imported one, and IMPORT_ERROR says which it is.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import os
import sys
from urllib.parse import unquote, urlparse

from .errors import SinkattnRuntimeError

_C = None
IMPORT_ERROR: str | None = None
SHADOWING: dict | None = None  # set when the missing extension is that of a hidden installed build (shadowing())

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def has_extension(package_dir: str) -> bool:
    """Whether a sinkattn package folder holds a compiled sinkattn._C for this Python."""
    try:
        names = os.listdir(package_dir)
    except OSError:
        return False
    return any(n.startswith("_C") and n.endswith(sfx) for n in names for sfx in importlib.machinery.EXTENSION_SUFFIXES)


def is_source_tree(package_dir: str) -> bool:
    """Whether a sinkattn package folder is the one of a clone (setup.py and csrc/ beside it)."""
    root = os.path.dirname(package_dir)
    return os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc"))


def _installed_dirs(search_path) -> list[str]:
    """Package folders of the sinkattn distributions pip installed (editable ones point at their clone)."""
    import importlib.metadata

    out = []
    for dist in importlib.metadata.distributions(name="sinkattn", path=list(search_path)):
        direct = dist.read_text("direct_url.json")
        if direct:
            try:
                info = json.loads(direct)
            except ValueError:
                info = {}
            if info.get("dir_info", {}).get("editable") and str(info.get("url", "")).startswith("file:"):
                out.append(os.path.join(unquote(urlparse(info["url"]).path), "sinkattn"))
                continue
        out.append(str(dist.locate_file("sinkattn")))
    return out


def shadowed(imported: str = PACKAGE_DIR, search_path=None) -> list[dict]:
    """The other sinkattn packages this process could have imported but did not: the folders of later
    sys.path entries holding a sinkattn package, and those of installed distributions. Each as
    {"path", "has_extension"}; empty when the imported package is the only one."""
    search_path = sys.path if search_path is None else search_path
    here = os.path.realpath(imported)
    candidates = [os.path.join(entry or os.getcwd(), "sinkattn") for entry in search_path]
    try:
        candidates += _installed_dirs(search_path)
    except Exception:  # broken metadata of some other distribution must not break the import
        pass
    out, seen = [], {here}
    for d in candidates:
        real = os.path.realpath(d)
        if real in seen or not os.path.isfile(os.path.join(real, "__init__.py")):
            continue
        seen.add(real)
        out.append({"path": real, "has_extension": has_extension(real)})
    return out


def shadowing(imported: str = PACKAGE_DIR, hidden: list[dict] | None = None) -> dict | None:
    """For an imported package without the extension: the installed build with one that it hides, as
    {"imported", "source_tree", "installed", "fix", "note"} (note: the sentence the errors and the report
    carry), or None when it hides none."""
    hidden = shadowed(imported) if hidden is None else hidden
    built = [h["path"] for h in hidden if h["has_extension"]]
    if not built:
        return None
    tree = is_source_tree(imported)
    if tree:
        fix = ("run from outside the clone (cd elsewhere), or make the clone the installed build "
               "(pip install --no-build-isolation -e .)")
    else:
        fix = f"take {os.path.dirname(imported)} off PYTHONPATH, or remove that copy"
    note = (f"sinkattn was imported from {'the source tree' if tree else 'the package'} {imported}, which has no "
            f"compiled extension (sinkattn._C), and it shadows the build installed at {built[0]}, which has one "
            f"(Python puts the current directory and PYTHONPATH ahead of site-packages); {fix}")
    return {"imported": imported, "source_tree": tree, "installed": built[0], "fix": fix, "note": note}


_spec = importlib.util.find_spec(__package__ + "._C")
# Only the package's own _C is loaded: a finder may offer one from another copy (setuptools' editable finder maps
# every sinkattn.* name to its clone, so a pure-Python install on PYTHONPATH would load that clone's binary,
# built from other sources).
_foreign = _spec is not None and _spec.origin is not None and \
    os.path.realpath(os.path.dirname(_spec.origin)) != os.path.realpath(PACKAGE_DIR)
if _spec is None or _foreign:
    SHADOWING = shadowing()
    if SHADOWING:
        IMPORT_ERROR = SHADOWING["note"]
    elif _foreign:
        IMPORT_ERROR = (f"the sinkattn._C on offer ({_spec.origin}) is not the imported package's own "
                        f"({PACKAGE_DIR}): it belongs to another copy of sinkattn and is not loaded")
    else:
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
        todo = "Or" if SHADOWING else "Build it with `pip install --no-build-isolation .` on a machine with nvcc, or"
        raise SinkattnRuntimeError(
            f"sinkattn's compiled extension (sinkattn._C) is not available: {IMPORT_ERROR}. {todo} use "
            "backend='reference'. `python -m sinkattn.report` says more.")
    return _C


@functools.lru_cache(maxsize=1)
def registry() -> tuple[dict, ...]:
    """The kernels compiled into the binary (empty without the extension)."""
    return tuple(_C.registry()) if _C is not None else ()


@functools.lru_cache(maxsize=1)
def build_info() -> dict | None:
    return dict(_C.build_info()) if _C is not None else None
