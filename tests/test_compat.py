"""sinkattn.compat.vllm_plugin against vLLM 0.33's real attention backend registry.

The plugin registers sinkattn's backend as vLLM's CUSTOM backend and nothing else. The FLASH_ATTN
monkeypatch and the `flash_attn_varlen_func` drop-in it used are gone: vLLM 0.33's function has 38
parameters (FA4-only ones among them) and a drop-in would have to track every release; the backend
(tests/test_vllm_backend.py) is the supported route.
"""
import importlib.util
import logging
import re
import sys
from pathlib import Path

import pytest

from sinkattn import compat
from tests import vllm_stubs
from tests.test_vllm_backend import vllm_src  # noqa: F401  (session fixture: the wheel, fetched once)


@pytest.fixture
def registry(vllm_src):  # noqa: F811
    vllm_stubs.install(vllm_src)
    from vllm.v1.attention.backends import registry as reg
    reg.AttentionBackendEnum.CUSTOM.clear_override()
    before = dict(reg._ATTN_OVERRIDES)
    yield reg
    reg.AttentionBackendEnum.CUSTOM.clear_override()
    assert {k: v for k, v in reg._ATTN_OVERRIDES.items() if k.name != "CUSTOM"} == before
    vllm_stubs.park()


def test_plugin_registers_the_custom_backend_only(registry):
    overrides = dict(registry._ATTN_OVERRIDES)
    sys.modules.pop("sinkattn.integrations.vllm_backend", None)
    compat.vllm_plugin()
    assert "sinkattn.integrations.vllm_backend" not in sys.modules  # a class path only; vLLM imports on use
    custom = registry.AttentionBackendEnum.CUSTOM
    assert custom.get_path() == compat.BACKEND_PATH
    changed = {k.name for k in set(registry._ATTN_OVERRIDES) | set(overrides)
               if registry._ATTN_OVERRIDES.get(k) != overrides.get(k)}
    assert changed == {"CUSTOM"}
    assert custom.get_class().get_name() == "CUSTOM"
    compat.vllm_plugin()  # idempotent
    assert custom.get_path() == compat.BACKEND_PATH


def test_plugin_leaves_another_packages_custom_backend(registry, caplog):
    registry.register_backend(registry.AttentionBackendEnum.CUSTOM, "other.pkg.Backend")
    with caplog.at_level(logging.WARNING, logger="sinkattn"):
        compat.vllm_plugin()
    assert registry.AttentionBackendEnum.CUSTOM.get_path() == "other.pkg.Backend"
    assert "already other.pkg.Backend" in caplog.text


def test_plugin_never_raises_without_vllm(monkeypatch, caplog):
    for name in ["vllm", *[n for n in sys.modules if n.startswith("vllm.")]]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import` raises ImportError
    monkeypatch.setenv("SINKATTN_VLLM", "1")
    with caplog.at_level(logging.WARNING, logger="sinkattn"):
        compat.vllm_plugin()
    assert "needs vLLM >= 0.33" in caplog.text
    assert "--attention-backend CUSTOM" in caplog.text  # the old switch says what replaced it


def test_setup_py_entry_point_names_the_plugin():
    setup = (Path(__file__).parent.parent / "setup.py").read_text()
    entry = re.search(r'"vllm\.general_plugins":\s*\["sinkattn = ([\w.]+):(\w+)"\]', setup)
    assert entry and entry.groups() == ("sinkattn.compat", "vllm_plugin")
    assert callable(compat.vllm_plugin)


def test_the_old_drop_in_is_gone():
    """vLLM 0.33's flash_attn_varlen_func signature is not ours to mirror; nothing may import the old names."""
    for name in ("flash_attn_varlen_func", "patch_vllm"):
        assert not hasattr(compat, name)


def test_vllm_is_gone_after_use(registry):
    """The tests put vLLM's modules back out of sight afterwards (later test modules must not see a vllm)."""
    vllm_stubs.park()
    assert not [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]
    assert not any(isinstance(f, vllm_stubs._Finder) for f in sys.meta_path)
    assert importlib.util.find_spec("vllm") is None
