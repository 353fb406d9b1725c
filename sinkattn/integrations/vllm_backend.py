"""sinkattn as a vLLM 0.33 attention backend (backend class, metadata builder, impl).

vLLM imports this module only when the user selects it: `sinkattn.compat.vllm_plugin` registers
`SinkattnBackend` as vLLM's CUSTOM backend, which vLLM's automatic selection never picks, so
installing sinkattn changes nothing until `--attention-backend CUSTOM` is given.

What it serves (gpt-oss and models like it): learnable sinks, sliding-window and full layers, GQA,
vLLM's paged KV cache (any page size), chunked prefill mixed with decode, prefix caching,
speculative decoding (query length 1 + k), full CUDA graphs for every batch, and FP8 KV caches
(`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`, with the layer's per-tensor or per-KV-head scales; vllm_paged
says how), selected only where a compiled kernel reads FP8. On vLLM's CPU platform (no compute capability) the
PyTorch reference serves, float32 included (validate_configuration's CPU mode; CI's vllm_engine leg runs it in
vLLM 0.32's CPU engine, whose backend classes are where 0.33 has them).

Per layer and step: the cache write is vLLM's own `reshape_and_cache_flash` (the op its FlashAttention backend
uses, FP8 with the layer's per-tensor scales) where vLLM's build has it (CUDA), else `vllm_paged.write_kv`; the
attention is one call, `vllm_paged.attend` (no vLLM import there, so the benchmark times the same code): one
kernel launch for the whole batch, whatever its mix of decodes, speculative rows and prefill chunks (plus one
combine under split-KV). `forward()` reads no device value on the host, and the launch depends only on the padded
sizes (tokens, requests), so the builder declares CUDA graphs for every batch (AttentionCGSupport.ALWAYS):
max_query_len, the one host value read, only picks the tile, and any tile is exact for any batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ..errors import SinkattnValueError
from ..layout import HEADDIM_MAX, HEADDIM_MULTIPLE, headdim_supported
from .vllm_paged import FP8_KV_DTYPES, attend, cache_views, kernel_gap, layer_scales, write_kv

_KV_DTYPES = ["auto", "float16", "bfloat16", *FP8_KV_DTYPES]


@dataclass
class SinkattnMetadata:
    num_actual_tokens: int
    max_query_len: int
    seq_lens: torch.Tensor       # (num_reqs,) int32: keys of each request, this step's included
    block_table: torch.Tensor    # (num_reqs, max_blocks) int32
    slot_mapping: torch.Tensor   # (num_tokens,) int64, -1 for padding tokens
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32 on the device: request b's queries


class SinkattnMetadataBuilder(AttentionMetadataBuilder[SinkattnMetadata]):
    # One launch whose grid and split count depend on the padded sizes alone (the packed M tiles of
    # common/seq_extent.h; each CTA finds its request on the device): a captured graph serves every batch of its
    # size, mixed ones included.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, speculative verifications (1 + k queries) counted as decodes: one call for them.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SinkattnMetadata:
        m = common_attn_metadata
        if not (m.causal is True):
            raise SinkattnValueError(f"sinkattn vLLM backend: causal={m.causal!r} in the batch metadata; accepted: "
                                     f"True (decoder self-attention)")
        return SinkattnMetadata(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                                seq_lens=m.seq_lens, block_table=m.block_table_tensor, slot_mapping=m.slot_mapping,
                                query_start_loc=m.query_start_loc)


class SinkattnImpl(AttentionImpl[SinkattnMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None):
        # Selection already refused what this impl cannot serve (SinkattnBackend.validate_configuration);
        # these checks catch a layer built around the selector.
        if alibi_slopes is not None:
            raise SinkattnValueError("sinkattn vLLM backend: alibi_slopes is not supported; accepted: None")
        if attn_type != AttentionType.DECODER:
            raise SinkattnValueError(f"sinkattn vLLM backend: attn_type={attn_type!r}; accepted: "
                                     f"{AttentionType.DECODER.value!r} (decoder self-attention)")
        if kv_cache_dtype not in _KV_DTYPES:
            raise SinkattnValueError(f"sinkattn vLLM backend: kv_cache_dtype={kv_cache_dtype!r}; accepted: "
                                     f"{_KV_DTYPES} (vLLM: --kv-cache-dtype auto, or fp8 for an e4m3 cache)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = FP8_KV_DTYPES.get(kv_cache_dtype)  # the FP8 element type, None for a bf16/fp16 cache
        # vLLM's sliding_window counts the query's own key: window w sees keys i-w+1 .. i, i.e. (w - 1, 0).
        self.window_size = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise SinkattnValueError(f"sinkattn vLLM backend: sinks has shape {tuple(sinks.shape)}; accepted: "
                                     f"({num_heads},), one logit per query head of this rank")

    def _scales(self, layer):
        """An FP8 cache's (k, v) scales, the layer's _k_scale/_v_scale tensors; None for other caches."""
        return None if self.cache_dtype is None else layer_scales(layer, self.num_kv_heads)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Write this step's K/V into the cache at slot_mapping: vLLM's reshape_and_cache_flash where vLLM's
        build has it (one fused op, as its FlashAttention backend writes; it skips padding slots), else
        vllm_paged.write_kv (padding tokens write zeros into vLLM's null block, so no host read; an FP8 cache gets
        x / scale with the layer's per-tensor or per-KV-head scales)."""
        k_cache, v_cache = cache_views(kv_cache, self.head_size, self.cache_dtype)
        op = _vllm_cache_writer(key, self._scales(layer))
        if op is not None:
            op(key, value, k_cache, v_cache, slot_mapping, self.kv_cache_dtype, layer._k_scale, layer._v_scale)
            return
        write_kv(k_cache, v_cache, key, value, slot_mapping, self._scales(layer))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise SinkattnValueError("sinkattn vLLM backend: fused output quantization (output_scale) is not "
                                     "supported; accepted: None")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        k_cache, v_cache = cache_views(kv_cache, self.head_size, self.cache_dtype)
        m = attn_metadata
        attend(query.view(-1, self.num_heads, self.head_size), k_cache, v_cache, m.seq_lens, m.block_table,
               m.query_start_loc, m.max_query_len, output.view(-1, self.num_heads, self.head_size), self.sinks,
               softmax_scale=self.scale, window_size=self.window_size, softcap=self.softcap,
               scales=self._scales(layer))
        return output


def _vllm_cache_writer(key, scales):
    """vLLM's reshape_and_cache_flash op (torch.ops._C_cache_ops), or None where it cannot write this step: vLLM's
    CPU build has no such op, and per-KV-head FP8 scales go to sinkattn's writer (the op takes one scale)."""
    if not key.is_cuda or (scales is not None and any(t.numel() != 1 for t in scales)):
        return None
    ops = getattr(torch.ops, "_C_cache_ops", None)
    return getattr(ops, "reshape_and_cache_flash", None) if ops is not None else None


class SinkattnBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]  # what the kernels take
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_KV_DTYPES)
    # vLLM calls impl.do_kv_cache_update before forward (its unified_kv_cache_update op).
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to its enum member: AttentionBackendEnum[get_name()]

    @staticmethod
    def get_impl_cls():
        return SinkattnImpl

    @staticmethod
    def get_builder_cls():
        return SinkattnMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return headdim_supported(head_size)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True  # compressed-tensors' attn_head scales: one per KV head, passed as (batch, nheads_k) descales

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is not None and (capability.major, capability.minor) >= (8, 0)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability):
        # Only a compiled kernel is worth selecting: the reference fallback is slow and cannot be graphed. An FP8
        # cache needs a kernel that reads FP8 (registry feature fp8_kv); dispatch.plan says which declined and why.
        # No capability: vLLM's CPU platform, where the reference is all there is (validate_configuration).
        if device_capability is None:
            return None
        kv_fp8 = kv_cache_dtype in FP8_KV_DTYPES
        reason = kernel_gap(head_size, dtype, device_capability, kv_fp8)
        cache = f" over an FP8 KV cache (kv_cache_dtype={kv_cache_dtype!r})" if kv_fp8 else ""
        return None if reason is None else (f"no compiled sinkattn kernel serves head_size={head_size} {dtype}"
                                            f"{cache} here ({reason})")

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # forward() reads the device's query_start_loc only; the host's max_query_len picks the tile, and every
        # tile is exact for any query lengths.
        return True

    @classmethod
    def validate_configuration(cls, **kw) -> list[str]:
        """vLLM's checks, with the refusals a user of this backend can meet spelled out.

        CPU mode: vLLM's CPU platform has no compute capability (device_capability None). There sinkattn runs its
        PyTorch reference, which also computes in float32, so neither float32 nor the missing capability is
        refused; on a GPU both refusals stand (the kernels take float16/bfloat16 and need cc 8.0)."""
        reasons = super().validate_configuration(**kw)
        if kw.get("device_capability") is None:
            cpu_ok = {"compute capability not supported"}
            if kw.get("dtype") == torch.float32:
                cpu_ok.add("dtype not supported")
            reasons = [r for r in reasons if r not in cpu_ok]
        explain = {
            "DCP not supported": "decode context parallelism (--decode-context-parallel-size > 1) is not served "
                                 "by sinkattn's backend (vLLM's DCP path would drop the sinks); run without it",
            "PCP not supported": "prefill context parallelism is not served by sinkattn's backend",
            "kv_cache_dtype not supported": f"kv_cache_dtype={kw.get('kv_cache_dtype')!r} is not served by sinkattn "
                                            f"(accepted: {_KV_DTYPES}; vLLM: --kv-cache-dtype auto, or fp8 for "
                                            f"an e4m3 cache with per-tensor or per-KV-head scales)",
            "compute capability not supported": "sinkattn's kernels need compute capability 8.0 or newer",
            "head_size not supported": f"head_size={kw.get('head_size')} (accepted: multiples of {HEADDIM_MULTIPLE} "
                                       f"up to {HEADDIM_MAX})",
            "dtype not supported": f"dtype={kw.get('dtype')} (sinkattn's kernels take float16 and bfloat16)",
        }
        out = [explain.get(r, r) for r in reasons]
        if not cls.supports_attn_type(kw.get("attn_type", AttentionType.DECODER)):
            out = [r for r in out if not r.startswith("attention type")]
            out.append(f"attention type {kw.get('attn_type')!r} (encoder or cross attention) is not served by "
                       f"sinkattn's backend; accepted: decoder self-attention")
        return [f"sinkattn: {r}" for r in out]
