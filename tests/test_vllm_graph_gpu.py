"""GPU: the vLLM backend's cache write + forward captured in a CUDA graph and replayed, as vLLM's full CUDA graphs
do for every batch (AttentionCGSupport.ALWAYS): decode, speculative 1 + k, and mixed batches of decodes and prefill
chunks. vllm_paged is the backend's whole forward and needs no vLLM, so this runs on a GPU machine without network.

Capture once at a padded size (tokens, requests); then, like vLLM between replays, rewrite the persistent buffers
in place (new queries and keys, other query lengths in query_start_loc, longer seq_lens, a grown block table) and
replay: the output must follow the new inputs (float64 oracle), which it can only do if nothing was read on the host
at capture and the launch depends on the padded sizes alone.
"""
import pytest
import torch

from sinkattn.integrations import vllm_paged
from tests.oracle import attention_oracle

H, HK, D, PAGE = 64, 8, 64, 16


def _backends():
    if not torch.cuda.is_available():
        return ["auto"]
    return ["auto", "sm80"] if torch.cuda.get_device_capability() == (9, 0) else ["auto"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", [127, -1], ids=["win128", "full"])
def test_graph_replay_follows_the_buffers(backend, window):
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(7 + window)
    b, tokens, max_blocks, num_blocks = 8, 64, 80, 8 * 80 + 1
    kv_cache = torch.randn(num_blocks, PAGE, HK, 2 * D, generator=g).to(dev, dt).permute(0, 2, 1, 3)
    k_cache, v_cache = vllm_paged.cache_views(kv_cache, D)
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: b * max_blocks] + 1).view(b, max_blocks)
    block_table = block_table.to(dev, torch.int32)
    seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
    qsl = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
    query = torch.empty(tokens, H, D, device=dev, dtype=dt)
    key, value = (torch.empty(tokens, HK, D, device=dev, dtype=dt) for _ in range(2))
    out = torch.zeros(tokens, H, D, device=dev, dtype=dt)
    sinks = torch.randn(H, generator=g).to(dev)
    w = (window, 0) if window >= 0 else (-1, -1)
    max_query_len = 4  # the capture's batch: speculative rows; the replays' longest chunk is longer

    def step():
        vllm_paged.write_kv(k_cache, v_cache, key, value, slot_mapping)
        vllm_paged.attend(query, k_cache, v_cache, seq_lens, block_table, qsl, max_query_len, out, sinks,
                          softmax_scale=D ** -0.5, window_size=w, backend=backend)

    def set_step(q_lens, lens):
        """vLLM's buffers for one step: request r has q_lens[r] new tokens ending at lens[r] keys."""
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        qsl.copy_(torch.tensor(starts, dtype=torch.int32))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        pos = torch.tensor([s - n + i for s, n in zip(lens, q_lens) for i in range(n)], device=dev, dtype=torch.long)
        rows = torch.arange(b, device=dev).repeat_interleave(torch.tensor(q_lens, device=dev))
        slot_mapping.fill_(-1)
        slot_mapping[:starts[-1]] = block_table[rows, pos // PAGE].long() * PAGE + pos % PAGE
        for t in (query, key, value):
            t.copy_(torch.randn(t.shape, generator=g).to(dev, dt))
        return starts

    set_step([4] * b, [300 + 7 * i for i in range(b)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replays = [([4] * b, [301 + 7 * i for i in range(b)]),                       # the capture's mix
               ([1] * b, [17, 600, 33, 250, 16, 129, 512, 2]),                    # decodes only
               ([1, 1, 1, 1, 1, 1, 30, 20], [900, 40, 2, 1000, 77, 31, 300, 20]),  # decodes + two prefill chunks
               ([1, 0, 1, 50, 0, 1, 1, 0], [10, 0, 1200, 60, 0, 5, 700, 0])]      # empty requests, a long chunk
    for q_lens, lens in replays:
        starts = set_step(q_lens, lens)
        graph.replay()
        torch.cuda.synchronize()
        for r, s in enumerate(lens):
            if q_lens[r] == 0:
                continue
            pos = torch.arange(s, device=dev)
            page = block_table[r].long()[pos // PAGE]
            k, v = k_cache[page, pos % PAGE][None], v_cache[page, pos % PAGE][None]
            rows = slice(starts[r], starts[r + 1])
            ref, _ = attention_oracle(query[None, rows], k, v, sinks, causal=True, window_size=w)
            torch.testing.assert_close(out[rows].double(), ref[0], rtol=0, atol=2e-2,
                                       msg=f"replay {q_lens}: request {r}")
