"""A vLLM general plugin for the vllm_engine leg (test code, never installed with sinkattn): vLLM's CPU platform serves
`attention_backend="CUSTOM"`.

vLLM's CpuPlatform.get_attn_backend_cls returns its own CPU backend whatever backend was selected (it only logs
"Cannot use ... backend on CPU" at INFO level), so sinkattn's registration as CUSTOM (sinkattn.compat.vllm_plugin)
is never consulted on a CPU. The leg's test writes an entry-point package for this module into a temporary folder
on sys.path, so vLLM's own plugin loader runs `plugin()` at start-up, in that venv only. It makes a CUSTOM selection
go where CudaPlatform sends it: the registered class, checked with its validate_configuration (device capability
None on a CPU), refused with the backend's reasons. Every other selection is vLLM's unchanged.
"""
from __future__ import annotations

ENTRY_POINT = "sinkattn_test_cpu_route"


def plugin() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_select = CpuPlatform.get_attn_backend_cls
    if getattr(cpu_select, "sinkattn_route", False):  # plugins may be loaded more than once per process
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend != AttentionBackendEnum.CUSTOM:
            return cpu_select(selected_backend, attn_selector_config, num_heads)
        backend = AttentionBackendEnum.CUSTOM.get_class()  # vLLM's error when nothing registered CUSTOM
        reasons = backend.validate_configuration(device_capability=cls.get_device_capability(),
                                                 **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend} is not valid for this configuration. "
                             f"Reason: {reasons}")
        return AttentionBackendEnum.CUSTOM.get_path()

    get_attn_backend_cls.sinkattn_route = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def write_package(folder) -> None:
    """An installed-looking distribution in `folder` (put it on sys.path): this module plus a dist-info whose
    entry point names it in vLLM's `vllm.general_plugins` group."""
    from pathlib import Path
    folder = Path(folder)
    (folder / f"{ENTRY_POINT}.py").write_text(Path(__file__).read_text())
    info = folder / f"{ENTRY_POINT}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ENTRY_POINT}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT} = {ENTRY_POINT}:plugin\n")
