"""sinkattn as a vLLM 0.33 attention backend (backend class, metadata builder, impl).

vLLM imports this module only when the user selects it: `sinkattn.compat.vllm_plugin` registers
`SinkattnBackend` as vLLM's CUSTOM backend, which vLLM's automatic selection never picks, so
installing sinkattn changes nothing until `--attention-backend CUSTOM` is given.

What it serves (gpt-oss and models like it): learnable sinks, sliding-window and full layers, GQA,
vLLM's paged KV cache (any page size), chunked prefill mixed with decode, prefix caching,
speculative decoding (query length 1 + k), full CUDA graphs for uniform batches.

How vLLM's batch maps onto `sinkattn.flash_attn_with_kvcache`:
- vLLM writes the step's new K/V into the cache first (`do_kv_cache_update`, by slot_mapping), so
  attention reads everything from the cache: cache_seqlens = seq_lens (keys per request, new ones
  included) and the queries are the last query_len positions of each request, which is exactly
  flash_attn_with_kvcache's bottom-right alignment.
- Requests are planned in `build()` from the host copy of query_start_loc (vLLM keeps one, so no
  device read): each run of consecutive requests with the same query length is one call on a view
  q[t0:t1].view(n, L, h, d) with seq_lens/block_table sliced [r0:r1]. vLLM puts decodes (length 1, or
  1 + k with speculation) first, so a decode or speculative batch is one call, and a mixed batch is
  one call for its decodes plus one per prefill chunk.
- `forward()` slices and views tensors only: it reads no device value on the host, so a uniform
  batch can be captured in a CUDA graph. A graph replays with the plan it was captured with, which
  is why CUDA graphs are declared for uniform batches only.
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
from ..interface import flash_attn_with_kvcache

_KV_DTYPES = ["auto", "float16", "bfloat16"]


@dataclass(frozen=True)
class Run:
    """Requests [r0, r1) all with query length L; their tokens start at row t0."""
    r0: int
    r1: int
    t0: int
    L: int


@dataclass
class SinkattnMetadata:
    num_actual_tokens: int
    max_query_len: int
    seq_lens: torch.Tensor       # (num_reqs,) int32: keys of each request, this step's included
    block_table: torch.Tensor    # (num_reqs, max_blocks) int32
    slot_mapping: torch.Tensor   # (num_tokens,) int64, -1 for padding tokens
    runs: tuple[Run, ...]


def plan_runs(query_start_loc_cpu: torch.Tensor, num_reqs: int) -> tuple[Run, ...]:
    """Runs of consecutive requests with equal query length, from the host copy of query_start_loc.
    Requests with no query (vLLM's padding requests in a padded batch) are skipped."""
    starts = query_start_loc_cpu[: num_reqs + 1].tolist()  # a CPU tensor: no device sync
    runs: list[Run] = []
    r = 0
    while r < num_reqs:
        L = starts[r + 1] - starts[r]
        r1 = r + 1
        while r1 < num_reqs and starts[r1 + 1] - starts[r1] == L:
            r1 += 1
        if L > 0:
            runs.append(Run(r, r1, starts[r], L))
        r = r1
    return tuple(runs)


class SinkattnMetadataBuilder(AttentionMetadataBuilder[SinkattnMetadata]):
    # A captured graph keeps the call plan of its capture; uniform batches (all decodes, or all 1 + k
    # speculative queries) keep one plan for every replay of the same size.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

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
                                runs=plan_runs(m.query_start_loc_cpu, m.num_reqs))


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
                                     f"{_KV_DTYPES} (vLLM: --kv-cache-dtype auto)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # vLLM's sliding_window counts the query's own key: window w sees keys i-w+1 .. i, i.e. (w - 1, 0).
        self.window_size = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise SinkattnValueError(f"sinkattn vLLM backend: sinks has shape {tuple(sinks.shape)}; accepted: "
                                     f"({num_heads},), one logit per query head of this rank")

    def _caches(self, kv_cache):
        # vLLM 0.33 hands every FlashAttention-style backend the logical (num_blocks, num_kv_heads, block_size,
        # 2 * head_size) view (K then V in the last dim), whatever the physical layout; swapping dims 1 and 2
        # gives the (num_pages, page_size, nheads_k, headdim) views flash_attn_with_kvcache reads, by strides.
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Write this step's K/V (num_tokens, nheads_k, head_size) into the cache at slot_mapping.

        Slot s is block s // block_size, offset s % block_size. Padding tokens have slot -1: they are sent
        to slot 0 instead of being masked out (a mask would need a device-to-host read, which a CUDA graph
        cannot hold). Block 0 is vLLM's null block (the block pool reserves it and never hands it to a
        request), so nothing reads what lands there."""
        k_cache, v_cache = self._caches(kv_cache)
        n = slot_mapping.shape[0]  # key/value may be padded beyond the scheduled tokens
        slots = slot_mapping.clamp(min=0).long()
        block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
        k_cache[block, offset] = key[:n].to(k_cache.dtype)
        v_cache[block, offset] = value[:n].to(v_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise SinkattnValueError("sinkattn vLLM backend: fused output quantization (output_scale) is not "
                                     "supported; accepted: None")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        k_cache, v_cache = self._caches(kv_cache)
        h, d = self.num_heads, self.head_size
        out = output.view(-1, h, d)
        m = attn_metadata
        for run in m.runs:
            n = run.r1 - run.r0
            rows = slice(run.t0, run.t0 + n * run.L)
            o = flash_attn_with_kvcache(query[rows].view(n, run.L, h, d), k_cache, v_cache, self.sinks,
                                        cache_seqlens=m.seq_lens[run.r0:run.r1],
                                        block_table=m.block_table[run.r0:run.r1], softmax_scale=self.scale,
                                        causal=True, window_size=self.window_size, softcap=self.softcap)
            out[rows].copy_(o.view(n * run.L, h, d))
        return output


class SinkattnBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
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
        return head_size % 8 == 0 and 8 <= head_size <= 256

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is not None and (capability.major, capability.minor) >= (8, 0)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # build() plans its calls from the host query lengths

    @classmethod
    def validate_configuration(cls, **kw) -> list[str]:
        """vLLM's checks, with the refusals a user of this backend can meet spelled out."""
        reasons = super().validate_configuration(**kw)
        explain = {
            "DCP not supported": "decode context parallelism (--decode-context-parallel-size > 1) is not served "
                                 "by sinkattn's backend (vLLM's DCP path would drop the sinks); run without it",
            "PCP not supported": "prefill context parallelism is not served by sinkattn's backend",
            "kv_cache_dtype not supported": f"kv_cache_dtype={kw.get('kv_cache_dtype')!r} is not served by sinkattn "
                                            f"(accepted: {_KV_DTYPES}; vLLM: --kv-cache-dtype auto)",
            "compute capability not supported": "sinkattn's kernels need compute capability 8.0 or newer",
            "head_size not supported": f"head_size={kw.get('head_size')} (accepted: multiples of 8 up to 256)",
        }
        out = [explain.get(r, r) for r in reasons]
        if not cls.supports_attn_type(kw.get("attn_type", AttentionType.DECODER)):
            out = [r for r in out if not r.startswith("attention type")]
            out.append(f"attention type {kw.get('attn_type')!r} (encoder or cross attention) is not served by "
                       f"sinkattn's backend; accepted: decoder self-attention")
        return [f"sinkattn: {r}" for r in out]
