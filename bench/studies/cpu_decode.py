"""CPU single-token decode through transformers: the sinkattn attention (reference backend) vs SDPA.

A Llama with SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads of 64), random weights, so
nothing is downloaded. After a prefill of --context tokens, times --steps single-token steps for each path,
interleaved in rounds on the same machine in the same run (a busy machine slows all paths alike), and
prints tokens/s (median over rounds, per wall second and per CPU second of this process):

    python -m bench.studies.cpu_decode [--context 512] [--steps 32] [--rounds 3] [--threads N]

Paths: sdpa + DynamicCache (transformers' own), sinkattn + DynamicCache, sinkattn + SinkCache(capacity).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(layers=30):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def rate(model, impl, cache, ids, context, steps):
    """(tokens per wall second, tokens per CPU second of this process) over `steps` single-token steps."""
    model.set_attn_implementation(impl)
    model(ids[:, :context], past_key_values=cache, use_cache=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(context, context + steps):
        model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    return steps / (time.perf_counter() - t0), steps / (time.process_time() - c0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import DynamicCache
    import sinkattn.integrations.transformers as sat
    sat.register()
    model = build(a.layers)
    ids = torch.randint(0, 49152, (1, a.context + a.steps), generator=torch.Generator().manual_seed(1))
    paths = {"sdpa + DynamicCache": ("sdpa", lambda: DynamicCache(config=model.config)),
             "sinkattn + DynamicCache": (sat.NAME, lambda: DynamicCache(config=model.config)),
             f"sinkattn + SinkCache({a.context})": (sat.NAME, lambda: sat.SinkCache.from_model(model, a.context, 4))}
    got = {name: [] for name in paths}
    for _ in range(a.rounds):
        for name, (impl, make) in paths.items():
            got[name].append(rate(model, impl, make(), ids, a.context, a.steps))
    print(f"single-token decode after {a.context} tokens, {a.steps} steps x {a.rounds} rounds, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median over rounds of tokens per wall "
          f"second and per CPU second of this process (steadier on a shared machine)")
    for name, r in got.items():
        wall, cpu = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
        print(f"  {name:34s} {wall:7.1f} tok/s wall  {cpu:7.1f} tok/CPU-s   "
              f"(rounds, wall: {', '.join(f'{x[0]:.1f}' for x in r)})")
    return {name: statistics.median(x[0] for x in r) for name, r in got.items()}


if __name__ == "__main__":
    main()
