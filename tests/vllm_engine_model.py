"""The vllm_engine leg's model, tokenizer and eager reference, all built at test time (no hub, no weights on disk).

`build(path)` saves a tiny random-weight gpt-oss (two layers: sliding-window then full, GQA 4:2, head dim 64, four
experts, sinks ~ N(0, 2**2) so they move the logits) and a word-level tokenizer to `path`, both loadable by vLLM and
by transformers. `EagerReference` is transformers' own eager gpt-oss over the same files; it can drop the sinks or the
window (the sensitivity check) and round K/V through an FP8 format (what an FP8 KV cache does to attention).

Weights are drawn wider than transformers' default init (std 0.02 gives near-uniform logits, where a greedy choice
would hang on margins of 1e-6); the checks need clear top-1 margins to compare token ids exactly.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from sinkattn import fp8

WINDOW = 16          # the sliding layer's window: every prompt is longer
VOCAB = 256
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def words(n: int, seed: int) -> list[str]:
    """n words of the tokenizer's vocabulary (no specials), a fixed draw."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - len(SPECIALS), (n,), generator=g).tolist()
    return [f"w{i}" for i in ids]


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def config():
    from transformers import GptOssConfig
    return GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                        pad_token_id=3, dtype="float32")


def build(path: Path, seed: int = 0) -> Path:
    from transformers import GptOssForCausalLM
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":  # logits of spread ~3: clear top-1 margins
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[-1]))
            elif p.dim() == 1 or "bias" in name:
                p.normal_(0.0, 0.05)
            else:  # fan-in scaled: activations stay O(1) through both layers
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-2] if "experts" in name else p.shape[-1]))
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return path


def _fp8_eager(cache_dtype):
    """transformers' eager gpt-oss attention on K/V rounded through `cache_dtype` with scale 1 (vLLM's default
    k_scale/v_scale), by sinkattn.fp8's rules: what attention over an FP8 KV cache computes."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    def attend(module, query, key, value, attention_mask, **kw):
        def rounded(x):  # (b, hk, s, d) -> the cache's values, back in x's dtype
            t = x.transpose(1, 2)
            one = torch.ones(t.shape[0], t.shape[2], dtype=torch.float32)
            return fp8.dequantize(fp8.quantize(t, one, cache_dtype), one[:, None], x.dtype).transpose(1, 2)
        return eager_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kw)
    return attend


class EagerReference:
    """Greedy next tokens and their logprobs from transformers' eager model, teacher-forced on given tokens.

    drop: None, "sinks" (every sink logit -inf: plain softmax) or "window" (both layers full attention).
    kv_cache_dtype: vLLM's name of an FP8 cache ("fp8_e4m3", "fp8_e5m2") to round K/V through, or "auto"."""

    def __init__(self, path: Path, drop: str | None = None, kv_cache_dtype: str = "auto"):
        from transformers import AttentionInterface, AttentionMaskInterface, GptOssForCausalLM
        from transformers.masking_utils import eager_mask
        kw = {}
        attn = "eager"
        if kv_cache_dtype != "auto":
            dtype = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                     "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
            attn = f"sinkattn_test_{kv_cache_dtype}"
            AttentionInterface.register(attn, _fp8_eager(dtype))
            # An attention function with no mask function of the same name gets no mask at all (transformers
            # leaves masking to such backends): the eager one, causal and windowed.
            AttentionMaskInterface.register(attn, eager_mask)
        if drop == "window":
            kw["layer_types"] = ["full_attention", "full_attention"]
        self.model = GptOssForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32, **kw)
        self.model.eval()
        if drop == "sinks":
            with torch.no_grad():
                for layer in self.model.model.layers:
                    layer.self_attn.sinks.fill_(float("-inf"))
        elif drop is not None and drop != "window":
            raise ValueError(f"drop={drop!r}; accepted: None, 'sinks', 'window'")

    @torch.no_grad()
    def greedy(self, prompt: list[int], generated: list[int]) -> tuple[list[int], list[float]]:
        """For each position that produced generated[i]: the eager argmax there, and the eager logprob of
        generated[i] (teacher-forced: one forward over prompt + generated[:-1])."""
        ids = torch.tensor([prompt + generated[:-1]])
        logits = self.model(ids).logits[0, len(prompt) - 1:].double()
        logp = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(generated)
        return logits.argmax(-1).tolist(), logp[torch.arange(len(generated)), chosen].tolist()
