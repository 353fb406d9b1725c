"""sinkattn: fused attention with attention sinks (see DESIGN.md). Importing touches no GPU."""
from .errors import SinkattnError, SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from .interface import flash_attn_varlen_with_sinks, flash_attn_with_kvcache, flash_attn_with_sinks
from .dispatch import ReferenceFallbackWarning

__version__ = "0.1.0"
