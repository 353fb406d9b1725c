"""vLLM's own Triton unified attention beside sinkattn's vLLM backend, on vLLM's paged KV layout.

vLLM 0.33 serves learnable sinks on Ampere/Ada (and wherever FlashAttention 3 is absent) with its
TRITON_ATTN backend, whose kernel is `vllm/v1/attention/ops/triton_unified_attention.py` (pure Triton,
plus `triton_attention_helpers.py`). That is what a gpt-oss user runs today; sinkattn's backend must beat it.

The peer's source comes from the vllm 0.33 wheel at run time and is never committed:

    python -m bench.harness.peer_vllm extract      # here, with PyPI: the two files -> third_party/.cache/vllm-peer/
    python -m bench.harness.peer_vllm run          # on the GPU machine (no network), carrying that folder

`load()` runs them unchanged under a few stand-in modules for their vLLM imports (logger, envs flag,
platform's fp8 dtype and arch family, triton re-export, the KVQuantMode enum), each below with its reason.

Both sides see the same inputs: gpt-oss heads (64 q, 8 kv, head dim 64, bf16, sinks), one KV cache tensor
in vLLM's logical layout (num_blocks, 8, 16, 128) over vLLM's default physical order (NHD), page size 16
(vLLM's default), random block tables, the same query_start_loc / seq_lens. The peer is called as
TritonAttentionImpl.forward calls it, with the split-K scratch TritonAttentionMetadataBuilder allocates
(threshold 128 // num_kv_heads sequences, 16 segments), and a block table as wide as vLLM's (a 128k
max_model_len: 8192 columns, whatever the batch's lengths). sinkattn runs `vllm_paged.attend`, the backend's
forward (one serving launch per batch), on "auto" and (cc 9.0) forced "sm80" and "sm90", and there vLLM's FlashAttention-3
build as its FLASH_ATTN backend calls it (`prep_vllm_fa3`, from the same wheel); on uniform batches also the
padded flash_attn_with_kvcache call it replaced (`sinkattn-padded`), which its decode must stay within 5% of. Both are
timed as CUDA graph replays where they capture
(vLLM runs decode in full CUDA graphs), else eagerly (the `method` column says which).

FP8 caches (`Batch.kv_cache_dtype` "fp8_e4m3" / "fp8_e5m2"): the same random K/V quantized
once into vLLM's uint8 allocation with per-tensor scales calibrated as vLLM's would be (amax / the format's largest
value), written by the backend's own writer (`vllm_paged.write_kv`). The peer is called as TritonAttentionImpl
calls it on such a cache: the cache viewed as the FP8 type, kv_quant_mode FP8_PER_TENSOR and the layer's scales
expanded to (num_seqs, num_kv_heads) (its kernel reads their first element: per tensor only). The decode grid holds
each FP8 case beside the same case over the bf16 cache; `run` measures the copy ceiling (ceilings.py) first and
gives every row GB/s (bytes at the cache's element size) and its fraction of that ceiling.
"""
from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import logging
import os
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import timing
from .prepared import Inputs, Prepared, Unsupported

VLLM_VERSION = "0.33.0"
FILES = ("vllm/v1/attention/ops/triton_attention_helpers.py", "vllm/v1/attention/ops/triton_unified_attention.py")
# vLLM's FlashAttention-3 build (its FLASH_ATTN backend on Hopper: learnable sinks as s_aux, paged KV, split-KV with a
# scheduler precomputed per step), a compiled extension inside the same wheel. 165 MB, 41 MB deflated: `extract` packs
# it into FA3_ZIP, which a GPU round carries beside .prebuilt.tar.xz (the pair fits one device call's 64 MB); every
# torch symbol it needs is in torch 2.14.1 (checked with nm against its libraries).
FA3_SO = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
FA3_ZIP = "vllm_fa3_C.zip"
# vLLM's cache writer of its Triton backend (the same bytes as the reshape_and_cache_flash op its FlashAttention
# backend calls): tests/test_vllm_fp8.py checks that sinkattn's fallback writer writes what it writes.
WRITER_FILE = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
ROOT = Path(__file__).resolve().parents[2]  # bench/harness/ -> the repository
PEER_DIR = ROOT / "third_party" / ".cache" / "vllm-peer" / f"vllm-{VLLM_VERSION}"  # git-ignored
H, HK, D, PAGE = 64, 8, 64, 16
MAX_MODEL_LEN = 131072  # gpt-oss; vLLM's block table has cdiv(max_model_len, block_size) columns per request
SEGMENTS = 16


# ---------------------------------------------------------------------------------------------- source
def _wheel() -> Path:
    cache = Path(os.environ.get("SINKATTN_CACHE", Path.home() / ".cache" / "sinkattn")) / f"vllm-{VLLM_VERSION}"
    found = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if found:
        return found[0]
    import subprocess
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
                    "--only-binary=:all:", "-d", str(cache), "-q"], check=True)
    return sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))[0]


def extract(dest: Path = PEER_DIR) -> Path:
    """Copy the peer's two source files out of the vllm wheel (downloaded once, without dependencies)."""
    with zipfile.ZipFile(_wheel()) as z:
        for name in (*FILES, WRITER_FILE):
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
        with zipfile.ZipFile(dest / FA3_ZIP, "w", zipfile.ZIP_DEFLATED) as fa3:
            fa3.writestr(FA3_SO, z.read(FA3_SO))
    return dest


def fa3_schema(so_bytes: bytes) -> list[str]:
    """The argument names of the FA3 extension's `fwd` op, read from the schema string its library registers (the
    bytes of _vllm_fa3_C: no GPU, no load)."""
    import re
    m = re.search(rb"fwd\((Tensor!\s+q,.*?)\)\s*->\s*Tensor\[\]", so_bytes, re.S)
    if m is None:
        raise ValueError("no fwd(...) schema in the FA3 extension's bytes")
    return [a.split()[-1] for a in m.group(1).decode().split(",")]


def load_fa3(src: Path = PEER_DIR):
    """torch.ops._vllm_fa3_C from the carried FA3_ZIP, loaded into this torch. Unpacked into the temporary directory,
    not next to the zip: the carried folder stays the 41 MB it was."""
    import tempfile
    packed = src / FA3_ZIP
    if not packed.exists():
        raise FileNotFoundError(f"{packed} is missing: run `python -m bench.harness.peer_vllm extract` where PyPI is "
                                f"reachable and carry it along")
    dest = Path(tempfile.gettempdir()) / f"sinkattn-vllm-{VLLM_VERSION}-fa3"
    so = dest / FA3_SO
    if not so.exists():
        with zipfile.ZipFile(packed) as z:
            z.extract(FA3_SO, dest)
    torch.ops.load_library(str(so))
    return torch.ops._vllm_fa3_C


# ---------------------------------------------------------------------------------------------- stand-ins
class KVQuantMode(enum.IntEnum):
    """vllm.v1.kv_cache_interface.KVQuantMode's members the kernel file names (it dispatches on identity)."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _Logger(logging.LoggerAdapter):
    """vllm.logger's logger: a standard logger plus the *_once methods the kernel file calls."""

    def debug_once(self, msg, *a, **k):
        self.debug(msg, *a)

    def info_once(self, msg, *a, **k):
        self.info(msg, *a)

    def warning_once(self, msg, *a, **k):
        self.warning(msg, *a)


class _Platform:
    """vllm.platforms.current_platform: the two questions the kernel file asks."""

    @staticmethod
    def fp8_dtype():
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(capability: int, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device_id)[0] == capability // 10


def load(src: Path = PEER_DIR):
    """vLLM's unified_attention, executed from the extracted source under the stand-ins above.

    The files import `vllm.*` by absolute name, so the stand-ins and the two modules sit in sys.modules
    under those names while they load; every entry is then restored to what it was (an installed vllm,
    or nothing), and the returned function keeps its module alive through its globals."""
    if not (src / FILES[1]).exists():
        raise FileNotFoundError(f"{src / FILES[1]} is missing: run `python -m bench.harness.peer_vllm extract` where "
                                f"PyPI is reachable and carry {PEER_DIR.relative_to(ROOT)} along")
    import triton
    import triton.language as tl
    mods = {n: types.ModuleType(n) for n in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")}
    for m in mods.values():
        m.__path__ = []
    mods["vllm.envs"] = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    mods["vllm.logger"] = types.SimpleNamespace(init_logger=lambda n: _Logger(logging.getLogger(n), {}))
    mods["vllm.platforms"] = types.SimpleNamespace(current_platform=_Platform())
    mods["vllm.triton_utils"] = types.SimpleNamespace(tl=tl, triton=triton)
    mods["vllm.v1.kv_cache_interface"] = types.SimpleNamespace(KVQuantMode=KVQuantMode)
    mods["vllm"].envs = mods["vllm.envs"]
    return _exec_under(mods, src, FILES).unified_attention


def _exec_under(mods: dict, src: Path, files) -> types.ModuleType:
    """Executes `files` (extracted from the wheel, in order) under their `vllm.*` names with the stand-in modules
    `mods` in sys.modules, then restores every entry to what it was (an installed vllm, or nothing); the last
    module is returned, kept alive by its functions' globals."""
    names = [f[:-3].replace("/", ".") for f in files]
    saved = {n: sys.modules.get(n) for n in [*mods, *names]}
    sys.modules.update(mods)
    try:
        for name, file in zip(names, files):
            spec = importlib.util.spec_from_file_location(name, src / file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return module
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


class _WriterPlatform(_Platform):
    """current_platform as the cache writer asks it: FP8 storable, and not CUDA (its CUDA branch asks the device's
    capability, which a CPU run under TRITON_INTERPRET=1 has not)."""

    @staticmethod
    def has_device_capability(capability, device_id: int = 0) -> bool:
        return True

    @staticmethod
    def is_rocm() -> bool:
        return not torch.cuda.is_available()

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_fp8_fnuz() -> bool:
        return False


def load_writer(src: Path = PEER_DIR):
    """vLLM's triton_reshape_and_cache_flash from the extracted source, under stand-ins as `load` does."""
    if not (src / WRITER_FILE).exists():
        raise FileNotFoundError(f"{src / WRITER_FILE} is missing: run `python -m bench.harness.peer_vllm extract`")
    import triton
    import triton.language as tl
    names = ("vllm", "vllm.utils", "vllm.model_executor", "vllm.model_executor.layers",
             "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.utils",
             "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")
    mods = {n: types.ModuleType(n) for n in names}
    for m in mods.values():
        m.__path__ = []
    platform = _WriterPlatform()
    fp8_info = torch.finfo(torch.float8_e4m3fn)
    mods["vllm.platforms"] = types.SimpleNamespace(current_platform=platform)
    mods["vllm.triton_utils"] = types.SimpleNamespace(tl=tl, triton=triton)
    # vLLM's is_quantized_kv_cache: any kv_cache_dtype other than the native ones (here: the fp8 names)
    quantized = lambda d: d.startswith("fp8")  # noqa: E731
    mods["vllm.v1.kv_cache_interface"] = types.SimpleNamespace(KVQuantMode=KVQuantMode,
                                                                is_quantized_kv_cache=quantized)
    mods["vllm.utils.torch_utils"] = types.SimpleNamespace(is_quantized_kv_cache=quantized)
    mods["vllm.model_executor.layers.quantization.utils.quant_utils"] = types.SimpleNamespace(
        FP8_DTYPE=torch.float8_e4m3fn, get_fp8_min_max=lambda: (fp8_info.min, fp8_info.max))
    return _exec_under(mods, src, (WRITER_FILE,)).triton_reshape_and_cache_flash


# ---------------------------------------------------------------------------------------------- one batch
@dataclass(frozen=True)
class Batch:
    name: str
    ctx: tuple            # cached tokens per request before this step
    q: tuple              # query tokens per request this step
    window: int = -1      # left window (127 for gpt-oss's sliding layers), -1 full
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: "auto" (bf16) or an FP8 name (vllm_paged.FP8_KV_DTYPES)

    @property
    def seq(self):
        return tuple(c + n for c, n in zip(self.ctx, self.q))


def make(batch: Batch, device, dtype=torch.bfloat16, seed=0):
    """Inputs as vLLM hands them to an attention impl (the cache already holds this step's K/V)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq = batch.seq
    pages_per = [-(-s // PAGE) for s in seq]
    num_blocks = 1 + sum(pages_per)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)  # block 0: vLLM's null block
    bt = torch.zeros(len(seq), -(-MAX_MODEL_LEN // PAGE), dtype=torch.int32)  # unused columns: null block
    i = 0
    for r, n in enumerate(pages_per):
        bt[r, :n], i = perm[i:i + n], i + n
    phys = torch.randn(num_blocks, PAGE, HK, 2 * D, device=device, dtype=dtype)  # NHD, vLLM's default order
    kv_cache = phys.permute(0, 2, 1, 3)  # the logical (num_blocks, HK, PAGE, 2D) view vLLM passes
    qsl = torch.tensor([0, *torch.tensor(batch.q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), H, D, device=device, dtype=dtype)
    sinks = (torch.randn(H, generator=g) + 1.0).to(device)
    x = dict(query=query, kv_cache=kv_cache, qsl=qsl, qsl_dev=qsl.to(device),
             seq_lens=torch.tensor(seq, dtype=torch.int32, device=device), block_table=bt.to(device), sinks=sinks)
    if batch.kv_cache_dtype != "auto":
        _to_fp8(x, batch.kv_cache_dtype)
    return x


def fp8_scales(k: torch.Tensor, v: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scales as a calibration would choose them: amax / the format's largest finite value (float32 0-dim
    tensors on the cache's device, as vLLM's layer._k_scale)."""
    big = torch.finfo(fmt).max
    return (k.abs().amax().float() / big), (v.abs().amax().float() / big)


def _to_fp8(x: dict, kv_cache_dtype: str, chunk_blocks: int = 4096) -> None:
    """Replace x's bf16 cache by vLLM's uint8 allocation (same physical order) holding it quantized by the backend's
    writer, a chunk of blocks at a time (a 17 GB bf16 cache needs no fp32 copy of itself)."""
    from sinkattn.integrations import vllm_paged
    fmt = vllm_paged.FP8_KV_DTYPES[kv_cache_dtype]
    bf = x["kv_cache"]  # logical (blocks, HK, PAGE, 2D) over NHD (blocks, PAGE, HK, 2D)
    k_bf, v_bf = vllm_paged.cache_views(bf, D)
    scales = fp8_scales(k_bf, v_bf, fmt)
    raw = torch.empty(bf.permute(0, 2, 1, 3).shape, dtype=torch.uint8, device=bf.device).permute(0, 2, 1, 3)
    k8, v8 = vllm_paged.cache_views(raw, D, fmt)
    for b0 in range(0, bf.shape[0], chunk_blocks):
        b1 = min(bf.shape[0], b0 + chunk_blocks)
        slots = torch.arange(b0 * PAGE, b1 * PAGE, device=bf.device)
        vllm_paged.write_kv(k8, v8, k_bf[b0:b1].reshape(-1, HK, D), v_bf[b0:b1].reshape(-1, HK, D), slots, scales)
    x.update(kv_cache=raw, kv_cache_dtype=kv_cache_dtype, fp8_dtype=fmt, scales=scales)


def prep_vllm(unified_attention, batch: Batch, x):
    """The call TritonAttentionImpl.forward makes, with TritonAttentionMetadataBuilder's scratch."""
    key_cache, value_cache = x["kv_cache"].transpose(1, 2).split(D, dim=-1)
    dev, num_seqs = x["query"].device, len(batch.q)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    quant = dict(k_descale=one.expand(num_seqs, HK), v_descale=one.expand(num_seqs, HK))
    if "fp8_dtype" in x:  # TritonAttentionImpl.forward on an FP8 cache: the FP8 view, per-tensor mode, layer scales
        key_cache, value_cache = key_cache.view(x["fp8_dtype"]), value_cache.view(x["fp8_dtype"])
        quant = dict(k_descale=x["scales"][0].expand(num_seqs, HK), v_descale=x["scales"][1].expand(num_seqs, HK),
                     kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    threshold = 128 // HK
    rows = threshold * min(max(batch.q), 8)  # scratch rows: 3D-eligible sequences x query tokens
    scratch = dict(seq_threshold_3D=threshold, num_par_softmax_segments=SEGMENTS,
                   softmax_segm_output=torch.empty(rows, H, SEGMENTS, triton_pow2(D), dtype=torch.float32, device=dev),
                   softmax_segm_max=torch.empty(rows, H, SEGMENTS, dtype=torch.float32, device=dev),
                   softmax_segm_expsum=torch.empty(rows, H, SEGMENTS, dtype=torch.float32, device=dev))
    out = torch.empty_like(x["query"])
    sinks = x["sinks"].to(x["query"].dtype)  # vLLM keeps sinks in the model dtype (make_attention_sink)
    window = (batch.window, 0) if batch.window >= 0 else (-1, -1)  # TritonAttentionImpl's sliding_window

    def run():
        unified_attention(q=x["query"], k=key_cache, v=value_cache, out=out, cu_seqlens_q=x["qsl_dev"],
                          max_seqlen_q=max(batch.q), seqused_k=x["seq_lens"], max_seqlen_k=max(batch.seq),
                          softmax_scale=D ** -0.5, causal=True, window_size=window,
                          block_table=x["block_table"], softcap=0, q_descale=None, sinks=sinks, **quant,
                          **scratch)
        return out
    return run


def fa3_call(batch: Batch, x, out, scheduler_metadata) -> dict:
    """The keyword arguments of _vllm_fa3_C.fwd as vLLM's FlashAttentionImpl.forward passes them on Hopper (by the
    op's own argument names: tests/test_peer_vllm.py checks them against the wheel's schema): the paged K/V views of
    the same cache, sinks as s_aux in the model dtype (the extension takes bf16 only), the step's scheduler."""
    from sinkattn.integrations import vllm_paged
    k_cache, v_cache = vllm_paged.cache_views(x["kv_cache"], D)
    none = dict.fromkeys(("k_new", "v_new", "q_v", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "kv_batch_idx",
                          "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale",
                          "v_descale", "pack_gqa", "cp_tot_seqused_k"))
    return dict(none, q=x["query"], k=k_cache, v=v_cache, out=out, cu_seqlens_q=x["qsl_dev"], seqused_k=x["seq_lens"],
                max_seqlen_q=max(batch.q), max_seqlen_k=max(batch.seq), page_table=x["block_table"],
                softmax_scale=D ** -0.5, is_causal=True, window_size_left=batch.window if batch.window >= 0 else -1,
                window_size_right=0 if batch.window >= 0 else -1, softcap=0.0, is_rotary_interleaved=True,
                scheduler_metadata=scheduler_metadata, num_splits=0, sm_margin=0,
                s_aux=x["sinks"].to(x["query"].dtype), cp_world_size=1, cp_rank=0)


def prep_vllm_fa3(fa3, batch: Batch, x):
    """vLLM's FlashAttention-3 on Hopper: the scheduler metadata computed once per step, outside the timed call, as
    vLLM's FlashAttentionMetadataBuilder computes it (shared by every layer), then one fwd per layer."""
    if "fp8_dtype" in x:
        raise Unsupported("vLLM's FA3 reads an FP8 cache only with FP8 queries (its backend quantizes q): not the same "
                          "call as sinkattn's")
    window = (batch.window, 0) if batch.window >= 0 else (-1, -1)
    sched = fa3.get_scheduler_metadata(
        batch_size=len(batch.q), max_seqlen_q=max(batch.q), max_seqlen_k=max(batch.seq), num_heads=H,
        num_heads_k=HK, headdim=D, headdim_v=D, qkv_dtype=x["query"].dtype, seqused_k=x["seq_lens"],
        cu_seqlens_q=x["qsl_dev"], cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, leftpad_k=None,
        page_size=PAGE, max_seqlen_k_new=0, is_causal=True, window_size_left=window[0], window_size_right=window[1],
        has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0)
    out = torch.empty_like(x["query"])
    kw = fa3_call(batch, x, out, sched)

    def run():
        fa3.fwd(**kw)
        return out
    run.served_by = "vllm-fa3"
    return run


def prep_sinkattn(batch: Batch, x, backend="auto"):
    """sinkattn's vLLM backend forward (vllm_paged.attend) on the same cache and metadata."""
    from sinkattn.integrations import vllm_paged
    k_cache, v_cache = vllm_paged.cache_views(x["kv_cache"], D, x.get("fp8_dtype"))
    scales = x.get("scales")  # an FP8 cache's layer scales, passed as the backend's forward passes them
    out = torch.empty_like(x["query"])
    sinks = x["sinks"].to(x["query"].dtype)
    window = (batch.window, 0) if batch.window >= 0 else (-1, -1)
    from sinkattn import dispatch
    from sinkattn._problem import Problem
    from sinkattn.mask import Mask
    problem = Problem.of_call("kvcache", x["query"][None, :1], k_cache, sinks,
                              Mask(scale=D ** -0.5, window_left=window[0], window_right=0), paged=True)
    served = dispatch.choose(problem, backend)
    if served == "reference" and x["query"].is_cuda:  # not worth a GPU lease's seconds
        why = dispatch.declined_text(dispatch.plan(problem)[1]) if backend == "auto" else "forced"
        raise RuntimeError(f"sinkattn would run its PyTorch reference here ({why})")

    def run():
        return vllm_paged.attend(x["query"], k_cache, v_cache, x["seq_lens"], x["block_table"], x["qsl_dev"],
                                 max(batch.q), out, sinks, softmax_scale=D ** -0.5, window_size=window,
                                 backend=backend, scales=scales)
    run.served_by = served
    return run


def prep_sinkattn_uniform(batch: Batch, x, backend="auto"):
    """The padded call a uniform batch (every request the same query length) ran before the serving call existed:
    flash_attn_with_kvcache on q viewed (requests, L, h, d). The serving call's decode must be within 5% of it."""
    if len(set(batch.q)) != 1:
        raise Unsupported("the padded call serves uniform batches only (one query length)")
    import sinkattn
    from sinkattn.integrations import vllm_paged
    k_cache, v_cache = vllm_paged.cache_views(x["kv_cache"], D, x.get("fp8_dtype"))
    b, L = len(batch.q), batch.q[0]
    q = x["query"].view(b, L, H, D)
    sinks = x["sinks"].to(x["query"].dtype)
    window = (batch.window, 0) if batch.window >= 0 else (-1, -1)
    extra = {}
    if x.get("scales") is not None:
        extra = dict(k_scale=x["scales"][0], v_scale=x["scales"][1])

    def run():
        return sinkattn.flash_attn_with_kvcache(q, k_cache, v_cache, sinks, cache_seqlens=x["seq_lens"],
                                                block_table=x["block_table"], softmax_scale=D ** -0.5, causal=True,
                                                window_size=window, backend=backend, **extra).view(-1, H, D)
    run.served_by = backend
    return run


_PEER = {}


def prep_case(case, x: Inputs, device) -> Prepared:
    """comparators.py's entry "vllm-triton": the peer on the shared grids' paged decode cases (vLLM reads
    only its paged layout), its K/V pages being the case's own (pages, page_size, nheads_k, headdim) caches; an FP8
    case's caches with its per-tensor scales (TritonAttentionImpl's FP8_PER_TENSOR call)."""
    if case.kind != "decode" or not case.paged:
        raise Unsupported("vLLM's Triton unified attention reads vLLM's paged KV cache: paged decode only")
    if device.type != "cuda":
        raise Unsupported("vLLM's Triton kernel runs on a GPU (tests/test_peer_vllm.py runs it interpreted)")
    if case.sink_tokens:
        raise Unsupported("vLLM's kernel has no StreamingLLM sink tokens")
    if "fn" not in _PEER:
        try:
            _PEER["fn"] = load()
        except FileNotFoundError as e:
            raise Unsupported(str(e)) from None
    fn = _PEER["fn"]
    b, sq, h, d = x.q.shape
    hk = x.k_cache.shape[2]
    q = x.q.reshape(b * sq, h, d)
    out = torch.empty_like(q)
    qsl = torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device=device)
    threshold = 128 // hk
    rows = threshold * min(sq, 8)
    scratch = dict(seq_threshold_3D=threshold, num_par_softmax_segments=SEGMENTS,
                   softmax_segm_output=torch.empty(rows, h, SEGMENTS, triton_pow2(d), dtype=torch.float32,
                                                   device=device),
                   softmax_segm_max=torch.empty(rows, h, SEGMENTS, dtype=torch.float32, device=device),
                   softmax_segm_expsum=torch.empty(rows, h, SEGMENTS, dtype=torch.float32, device=device))
    one = torch.ones(1, dtype=torch.float32, device=device)
    window = (case.window_left, 0) if case.window_left >= 0 else (-1, -1)
    quant = dict(k_descale=one.expand(b, hk), v_descale=one.expand(b, hk))
    if getattr(case, "kv_dtype", "auto") != "auto":  # comparators.FP8Inputs: FP8 caches, per-tensor scales
        quant = dict(k_descale=x.k_scale.expand(b, hk), v_descale=x.v_scale.expand(b, hk),
                     kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)

    def run():
        fn(q=q, k=x.k_cache, v=x.v_cache, out=out, cu_seqlens_q=qsl, max_seqlen_q=sq, seqused_k=x.cache_seqlens,
           max_seqlen_k=case.seqlen_k, softmax_scale=d ** -0.5, causal=True, window_size=window,
           block_table=x.block_table, softcap=0, q_descale=None, sinks=x.sinks, **quant, **scratch)
        return out.view(b, sq, h, d)
    return Prepared(run, "exact (native)" if case.sinks else "none needed", "triton (vLLM 0.33)", output=run,
                    graphable=device.type == "cuda")


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------- grid
FP8_DECODE = {"fp8_e4m3": "all", "fp8_e5m2": ((64, 32768),)}  # which decode cases also run over each FP8 cache


def grid(quick: bool = False) -> list[Batch]:
    """Decode batches 1..256 at 8k..32k tokens of context, speculative (1 + 3) decode, and mixed batches
    (decodes plus chunked-prefill chunks, one over a cached prefix), each with window 128 and full. Each decode
    case is followed by the same case over an e4m3 cache (and b64/sk32768 over e5m2), named with the FP8 suffix
    (`fp8_pairs` pairs them)."""
    out = []
    for window in (127, -1):
        tag = "win128" if window >= 0 else "full"
        for b in ((1, 64, 256) if quick else (1, 4, 16, 64, 256)):
            for sk in ((8192, 32768) if quick else (8192, 16384, 32768)):
                out.append(Batch(f"decode/{tag}/b{b}/sk{sk}", (sk - 1,) * b, (1,) * b, window))
                for kv, which in FP8_DECODE.items():
                    if which == "all" or (b, sk) in which:
                        out.append(Batch(f"decode/{tag}/b{b}/sk{sk}/{kv}", (sk - 1,) * b, (1,) * b, window, kv))
        for b in ((64,) if quick else (16, 64)):
            out.append(Batch(f"spec4/{tag}/b{b}/sk32768", (32768 - 4,) * b, (4,) * b, window))
        for b, sk in (((64, 16384),) if quick else ((16, 8192), (64, 16384), (256, 8192))):
            out.append(Batch(f"mixed/{tag}/b{b}+2pf/sk{sk}", (sk - 1,) * b + (0, 8192), (1,) * b + (2048, 2048),
                             window))
    return out


def fp8_pairs(batches) -> dict[str, str]:
    """FP8 case name -> the name of the same case over the bf16 cache."""
    return {b.name: b.name.rsplit("/", 1)[0] for b in batches if b.kv_cache_dtype != "auto"}


def kv_bytes(batch: Batch) -> int:
    """K + V bytes one call must read at least (visible keys only, at the cache's element size: 1 for FP8), plus
    q and out (bf16)."""
    per_tok = 2 * HK * D * (1 if batch.kv_cache_dtype != "auto" else 2)
    keys = sum(min(s, batch.window + n) if batch.window >= 0 else s for s, n in zip(batch.seq, batch.q))
    return keys * per_tok + 2 * sum(batch.q) * H * D * 2


def run(args) -> list[dict]:
    device = torch.device("cuda")
    unified_attention = load(Path(args.src))
    cc = torch.cuda.get_device_capability()
    comparators = {"vllm-triton": lambda b, x: prep_vllm(unified_attention, b, x),
                   "sinkattn": lambda b, x: prep_sinkattn(b, x, "auto"),
                   # the padded per-group call the serving call replaced (uniform batches only): the decode target
                   "sinkattn-padded": lambda b, x: prep_sinkattn_uniform(b, x, "auto")}
    if cc == (9, 0):
        comparators["sinkattn-sm80"] = lambda b, x: prep_sinkattn(b, x, "sm80")
        # the sm90 forward over the paged cache ("auto" keeps cache calls on sm80 until SM90_CACHE_VALIDATED)
        comparators["sinkattn-sm90"] = lambda b, x: prep_sinkattn(b, x, "sm90")
        # what vLLM serves gpt-oss with on Hopper: its FA3 build (the target: the sm90 column >= 1.2x of it)
        try:
            fa3 = load_fa3(Path(args.src))
            comparators["vllm-fa3"] = lambda b, x: prep_vllm_fa3(fa3, b, x)
        except (OSError, RuntimeError) as e:
            print(f"vllm-fa3: not loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
    from . import ceilings
    copy = ceilings.measure_copy(device)  # GB/s of a large device copy (read + write), this run's ceiling
    print(f"copy ceiling: {copy['copy_GBps']:.1f} GB/s", flush=True)
    rows = []
    for batch in grid(args.quick):
        x = make(batch, device)
        ref = None
        for name, prep in comparators.items():
            row = dict(case=batch.name, comparator=name, kv_cache_dtype=batch.kv_cache_dtype, tokens=sum(batch.q),
                       bytes=kv_bytes(batch), copy_GBps=copy["copy_GBps"])
            try:
                fn = prep(batch, x)
                row["served_by"] = getattr(fn, "served_by", "triton")
                out = fn().float().clone()
                if ref is None:
                    ref = out
                else:
                    row["max_abs_diff_vs_vllm"] = (out - ref).abs().max().item()
                t = timing.bench(fn, device, use_graph=True, budget_ms=args.budget_ms)
                row.update(t.as_dict(), status="ok", gbps=row["bytes"] / t.median_ms / 1e6)
                row["frac_copy_ceiling"] = row["gbps"] / copy["copy_GBps"]
            except Exception as e:  # noqa: BLE001 - one failure must not stop the grid
                row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """One line per case: each comparator's median and sinkattn's speedup over vLLM's Triton kernel, sinkattn's
    fraction of the copy ceiling, for an FP8 case sinkattn's speedup over itself on the bf16 cache, and on Hopper the
    sm90 forward's speedup over vLLM's FA3."""
    by = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["comparator"]] = r
    lines = [f"{'case':47s} {'vllm-triton ms':>14s} {'sinkattn ms':>12s} {'x':>6s} {'sm80 ms':>9s} {'x':>6s} "
             f"{'copy':>5s} {'vs bf16':>7s} {'fa3 ms':>8s} {'sm90 ms':>8s} {'x fa3':>6s}"]
    for case, d in by.items():
        v = d.get("vllm-triton", {}).get("median_ms")
        cells = [f"{case:47s}", f"{v:14.4f}" if v else f"{'-':>14s}"]
        for n, w in (("sinkattn", 12), ("sinkattn-sm80", 9)):
            t = d.get(n, {}).get("median_ms")
            cells += [f"{t:{w}.4f}" if t else f"{'-':>{w}s}", f"{v / t:6.2f}" if (t and v) else f"{'-':>6s}"]
        frac = d.get("sinkattn", {}).get("frac_copy_ceiling")
        cells.append(f"{frac:5.2f}" if frac else f"{'-':>5s}")
        t, bf = d.get("sinkattn", {}).get("median_ms"), None
        if "/fp8_" in case:
            bf = by.get(case.rsplit("/", 1)[0], {}).get("sinkattn", {}).get("median_ms")
        cells.append(f"{bf / t:7.2f}" if (t and bf) else f"{'-':>7s}")
        fa3, sm90 = d.get("vllm-fa3", {}).get("median_ms"), d.get("sinkattn-sm90", {}).get("median_ms")
        cells += [f"{fa3:8.4f}" if fa3 else f"{'-':>8s}", f"{sm90:8.4f}" if sm90 else f"{'-':>8s}",
                  f"{fa3 / sm90:6.2f}" if (fa3 and sm90) else f"{'-':>6s}"]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.harness.peer_vllm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="copy the peer's source out of the vllm wheel (needs PyPI once)")
    e.add_argument("--dest", default=str(PEER_DIR))
    r = sub.add_parser("run", help="time both on this GPU; writes $OUT/peer_vllm.json")
    r.add_argument("--src", default=str(PEER_DIR))
    r.add_argument("--quick", action="store_true", help="a third of the grid (for a short lease)")
    r.add_argument("--budget-ms", type=float, default=300.0, help="timed runs per comparator and case")
    args = p.parse_args(argv)
    if args.cmd == "extract":
        print(f"peer source: {extract(Path(args.dest))}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench.harness.peer_vllm run: needs a CUDA GPU (tests/test_peer_vllm.py checks both sides on the CPU)")
    rows = run(args)
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_vllm.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
