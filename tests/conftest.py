import os

import pytest
import torch

from sinkattn import _ext

# `@pytest.mark.needs_ext`: a test that calls into the compiled extension (sinkattn._C) itself, skipped with the
# reason on a build without it (the pure-Python build, SINKATTN_SKIP_CUDA=1, or one whose _C does not load).
NEEDS_EXT_REASON = f"needs the compiled extension sinkattn._C: {_ext.IMPORT_ERROR}"


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_ext: calls the compiled extension sinkattn._C (skipped without it)")


def pytest_collection_modifyitems(config, items):
    skip_ext = None if _ext.loaded() else pytest.mark.skip(reason=NEEDS_EXT_REASON)
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_ext is not None and "needs_ext" in item.keywords:
            item.add_marker(skip_ext)


@pytest.fixture
def rng_seed():
    """A fresh seed per test run (printed on failure) so inputs are never the same twice."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny models' ops are too small to share; the transformers tests use it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
