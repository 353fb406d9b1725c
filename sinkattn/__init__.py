"""sinkattn: fused attention with attention sinks (learnable sink logits and StreamingLLM sink tokens).

Import is cheap: torch is imported (the extension needs it), the compiled extension is loaded if present
(its failure is recorded, not raised), and no CUDA context is created.
"""
import torch  # noqa: F401  (loads libc10/libtorch, which sinkattn._C links against)

from ._version import __version__  # noqa: E402

from .errors import SinkattnError, SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError  # noqa: E402
from . import _device, _ext  # noqa: E402
from ._device import get_sm80_smem_limit, sm80_smem_limit  # noqa: E402
from .capability import capabilities  # noqa: E402
from .merge import merge_attn_states  # noqa: E402

from .interface import flash_attn_varlen_with_sinks, flash_attn_with_kvcache, flash_attn_with_sinks  # noqa: E402
from .dispatch import ReferenceFallbackWarning  # noqa: E402
from .streaming import SinkKVCache  # noqa: E402

# What this process can run on, read at import without creating a CUDA context (NVML; empty on a machine
# without a driver): dispatch and the report reuse it.
CUDA_VERSION = torch.version.cuda
DEVICES = _device.nvml_devices()

__all__ = [
    "flash_attn_with_sinks", "flash_attn_varlen_with_sinks", "flash_attn_with_kvcache", "merge_attn_states",
    "SinkKVCache", "capabilities", "ReferenceFallbackWarning", "SinkattnError", "SinkattnValueError",
    "SinkattnTypeError", "SinkattnRuntimeError", "sm80_smem_limit", "get_sm80_smem_limit",
]
