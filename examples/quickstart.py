"""A short example of sinkattn.flash_attn_with_sinks: gpt-oss-style attention (learnable sinks, window 128)."""
import torch

import sinkattn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
batch, seqlen, nheads, nheads_k, headdim = 2, 512, 8, 2, 64
q = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype)
k = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=dtype)
v = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=dtype)
sinks = torch.randn(nheads, device=device)  # one learnable logit per query head

out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(127, 0), return_lse=True)
print(f"gpt-oss-style layer on {device}: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}")
# The sink takes probability mass exp(sink - lse) from every row: the attention weights sum to 1 minus that.
print(f"mean probability mass absorbed by the sink: {torch.exp(sinks.view(1, -1, 1) - lse).mean().item():.3f}")

# StreamingLLM: the first 4 tokens stay visible however far the 256-token window has moved on.
out = sinkattn.flash_attn_with_sinks(q, k, v, causal=True, window_size=(255, 0), sink_tokens=4)
print(f"StreamingLLM mask (4 sink tokens + window 256): out {tuple(out.shape)}")
