"""vLLM integration entry point: the general plugin that registers sinkattn's attention backend.

setup.py declares `vllm.general_plugins: sinkattn = sinkattn.compat:vllm_plugin`, so every vLLM process
calls `vllm_plugin()` at start-up. It registers `sinkattn.integrations.vllm_backend.SinkattnBackend` as
vLLM's CUSTOM attention backend (vLLM >= 0.33: `register_backend(AttentionBackendEnum.CUSTOM, path)`).
Registration stores a class path only: nothing is imported, and vLLM's automatic selection never picks
CUSTOM, so vLLM chooses exactly what it chose without sinkattn until the user asks:

    vllm serve openai/gpt-oss-20b --attention-backend CUSTOM

The plugin never raises (an exception there would stop every vLLM start-up in the environment): on a vLLM
without the registry or the CUSTOM member, or with CUSTOM already registered by another package, it logs
why and leaves vLLM alone.
"""
from __future__ import annotations

import logging
import os

BACKEND_PATH = "sinkattn.integrations.vllm_backend.SinkattnBackend"
_log = logging.getLogger("sinkattn")


def register_vllm_backend() -> str:
    """Register SinkattnBackend as vLLM's CUSTOM attention backend. Returns what was done, in words."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        return f"not registered: vLLM's attention backend registry is not importable ({e}); needs vLLM >= 0.33"
    custom = getattr(AttentionBackendEnum, "CUSTOM", None)
    if custom is None:
        return "not registered: this vLLM has no AttentionBackendEnum.CUSTOM; needs vLLM >= 0.33"
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        return f"not registered: vLLM's CUSTOM backend is already {custom.get_path()}"
    register_backend(custom, BACKEND_PATH)
    return f"registered {BACKEND_PATH} as vLLM's CUSTOM attention backend (--attention-backend CUSTOM)"


def vllm_plugin() -> None:
    """vLLM `vllm.general_plugins` entry point (see the module docstring)."""
    try:
        what = register_vllm_backend()
    except Exception as e:  # noqa: BLE001  (a plugin must not stop vLLM)
        what = f"not registered: {type(e).__name__}: {e}"
    (_log.info if what.startswith("registered") else _log.warning)("sinkattn: %s", what)
    if os.environ.get("SINKATTN_VLLM") == "1":
        _log.warning("sinkattn: SINKATTN_VLLM=1 no longer patches vLLM's FLASH_ATTN backend; select sinkattn "
                     "with --attention-backend CUSTOM")
