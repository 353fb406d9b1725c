"""GPU: the vLLM backend's cache write + forward captured in a CUDA graph and replayed, as vLLM's full
CUDA graphs do for uniform batches (decode, and speculative 1 + k). vllm_paged is the backend's whole
forward and needs no vLLM, so this runs on a GPU machine without network.

Capture once; then, like vLLM between replays, rewrite the persistent buffers in place (new queries, new
keys, longer seq_lens, a grown block table) and replay: the output must follow the new inputs (float64
oracle), which it can only do if nothing was read on the host at capture.
"""
import pytest
import torch

from sinkattn import kvcache
from sinkattn.integrations import vllm_paged
from tests.oracle import attention_oracle

H, HK, D, PAGE = 64, 8, 64, 16


def _backends():
    if not torch.cuda.is_available():
        return ["auto"]
    return ["auto", "sm80"] if torch.cuda.get_device_capability() == (9, 0) else ["auto"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("L, window", [(1, 127), (4, -1), (4, 127)], ids=["decode-win128", "spec4-full",
                                                                          "spec4-win128"])
def test_graph_replay_follows_the_buffers(backend, L, window):
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(L + window)
    b, max_blocks, num_blocks = 8, 40, 8 * 40 + 1
    kv_cache = torch.randn(num_blocks, PAGE, HK, 2 * D, generator=g).to(dev, dt).permute(0, 2, 1, 3)
    k_cache, v_cache = vllm_paged.cache_views(kv_cache, D)
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: b * max_blocks] + 1).view(b, max_blocks)
    block_table = block_table.to(dev, torch.int32)
    seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
    slot_mapping = torch.zeros(b * L, dtype=torch.long, device=dev)
    query = torch.empty(b * L, H, D, device=dev, dtype=dt)
    key, value = (torch.empty(b * L, HK, D, device=dev, dtype=dt) for _ in range(2))
    out = torch.empty(b * L, H, D, device=dev, dtype=dt)
    sinks = torch.randn(H, generator=g).to(dev)
    runs = kvcache.plan_runs(torch.arange(0, b * L + 1, L, dtype=torch.int32), b)
    w = (window, 0) if window >= 0 else (-1, -1)

    def step():
        vllm_paged.write_kv(k_cache, v_cache, key, value, slot_mapping)
        vllm_paged.attend(query, k_cache, v_cache, seq_lens, block_table, runs, out, sinks,
                          softmax_scale=D ** -0.5, window_size=w, backend=backend)

    def set_step(lens):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        pos = torch.tensor([s - L + i for s in lens for i in range(L)], device=dev)
        rows = torch.arange(b, device=dev).repeat_interleave(L)
        slot_mapping.copy_(block_table[rows, pos // PAGE].long() * PAGE + pos % PAGE)
        for t in (query, key, value):
            t.copy_(torch.randn(t.shape, generator=g).to(dev, dt))

    set_step([300 + 7 * i for i in range(b)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([301 + 7 * i for i in range(b)], [17, 600, 33, 250, 16, 129, 512, 2]):
        set_step([max(x, L) for x in lens])
        graph.replay()
        torch.cuda.synchronize()
        for r, s in enumerate(seq_lens.tolist()):
            pos = torch.arange(s, device=dev)
            page = block_table[r].long()[pos // PAGE]
            k, v = k_cache[page, pos % PAGE][None], v_cache[page, pos % PAGE][None]
            ref, _ = attention_oracle(query[None, r * L:(r + 1) * L], k, v, sinks, causal=True, window_size=w)
            torch.testing.assert_close(out[r * L:(r + 1) * L].double(), ref[0], rtol=0, atol=2e-2)
