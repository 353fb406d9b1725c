// perf_counts_harness.cpp: one sm80 forward (batch 1, one head, seqlen_q = seqlen_k = S, head dim HD, bf16), and with
// a fourth argument `bwd` the backward of it too (emu/bwd_sm80_emu.h), run
// on the CPU by the host emulation of the tree it is compiled against (csrc/emu/fwd_sm80_emu.h: the kernel's own
// body), built with gcov so that every source line of the kernel counts its executions on this problem.
// tools/perf_counts.sh builds and runs it; tools/perf_counts.py weighs the kernel's SASS blocks with the counts. With
// `decode` as the fourth argument (and a page size as the fifth), a decode step over a cache instead.
// No torch: the emulation headers need only CUTLASS/CuTe. A dense problem with an interior of whole key blocks:
// what the model's measured prefill rows run.
#include "emu/fwd_sm80_emu.h"
#ifdef PERF_COUNTS_BWD  // built so by tools/perf_counts.sh with PERF_COUNTS_BWD=1 (a tree older than the harness may lack it)
#include "emu/bwd_sm80_emu.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

// Decode: one query per request over a cache of s keys, 8 query heads per KV head packed into one tile (gpt-oss and
// Llama-70B heads: 64 over 8), causal (every key), no split; the cache contiguous (page 0) or a pool of pages of
// `page` rows in a shuffled order: what the measured decode rows run. Fields a tree may lack are set where it has them.
int run_decode(int s, int page, int smem) {
  using namespace sinkattn;
  using E = cutlass::bfloat16_t;
  int const d = HD, g = 8, pages = page ? (s + page - 1) / page : 0, pool = page ? pages * page : s;
  std::mt19937 gen(1);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<E> q(g * d), k(size_t(pool) * d), v(size_t(pool) * d), o(g * d);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = E(n(gen));
  std::vector<float> lse(g);
  FwdParams p;
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = o.data(); p.lse = lse.data();
  p.q_batch_stride = p.o_batch_stride = int64_t(g) * d;
  p.q_row_stride = p.o_row_stride = int64_t(g) * d;
  p.q_head_stride = p.o_head_stride = d;
  p.k_row_stride = p.v_row_stride = d;
  p.k_head_stride = p.v_head_stride = d;
  p.k_batch_stride = p.v_batch_stride = page ? int64_t(page) * d : int64_t(s) * d;
  p.lse_batch_stride = g;
  p.lse_head_stride = 1;
  p.batch = 1; p.nheads = g; p.nheads_k = 1; p.seqlen_q = 1; p.seqlen_k = s; p.headdim = d; p.headdim_rounded = d;
  p.total_q = 1; p.total_k = s;
  p.softmax_scale = 1.f / std::sqrt(float(d));
  p.window_left = -1;
  p.window_right = 0;
  p.pack_gqa = 1;
  std::vector<int> table;
  if (page) {
    for (int i = 0; i < pages; ++i) table.push_back(i);
    std::shuffle(table.begin(), table.end(), gen);
    p.block_table = table.data();
    p.block_table_batch_stride = pages;
    p.page_size = page;
    [&](auto& t) {
      if constexpr (requires { t.page_shift; }) t.page_shift = (page & (page - 1)) ? -1 : __builtin_ctz(page);
      if constexpr (requires { t.num_pages; }) t.num_pages = pages;
    }(p);
  }
  p.max_smem_per_block = smem;
  EmuLaunch l;
  l.max_smem_per_block = smem;
  run_fwd_sm80_emulated<HD, E>(p, l);
  // The step the counts describe must be the step asked for: each head's output against a float softmax over the
  // cache's rows where the page table puts them.
  auto row_of = [&](int j) { return page ? size_t(table[j / page]) * page + j % page : size_t(j); };
  for (int h = 0; h < g; ++h) {
    std::vector<float> w(s);
    float mx = -INFINITY, sum = 0.f;
    for (int j = 0; j < s; ++j) {
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += float(q[h * d + c]) * float(k[row_of(j) * d + c]);
      w[j] = dot * p.softmax_scale;
      mx = std::max(mx, w[j]);
    }
    for (int j = 0; j < s; ++j) sum += w[j] = std::exp(w[j] - mx);
    for (int c = 0; c < d; ++c) {
      float acc = 0.f;
      for (int j = 0; j < s; ++j) {
        acc += w[j] * float(v[row_of(j) * d + c]);
      }
      if (std::fabs(acc / sum - float(o[h * d + c])) > 2e-2f) return 2;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  using namespace sinkattn;
  using E = cutlass::bfloat16_t;
  if (argc > 4 && std::string(argv[4]) == "decode")
    return run_decode(std::atoi(argv[1]), argc > 5 ? std::atoi(argv[5]) : 0, std::atoi(argv[3]) * 1024);
  int const s = argc > 1 ? std::atoi(argv[1]) : 1024, d = HD, h = 1;
  bool const causal = argc > 2 && argv[2][0] == 'c';
  std::mt19937 g(1);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<E> q(s * h * d), k(s * h * d), v(s * h * d), o(s * h * d);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = E(n(g));
  std::vector<float> lse(h * s);
  FwdParams p;
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = o.data(); p.lse = lse.data();
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(s) * h * d;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = h * d;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
  p.lse_batch_stride = int64_t(h) * s;
  p.lse_head_stride = s;
  p.batch = 1; p.nheads = h; p.nheads_k = h; p.seqlen_q = s; p.seqlen_k = s; p.headdim = d; p.headdim_rounded = d;
  p.softmax_scale = 1.f / std::sqrt(float(d));
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  // An H100 / H200's limit by default (the tile the measured rows ran); a third argument (KB) picks the tile another
  // limit takes (an A100's 163, an sm86's 99).
  int const smem = (argc > 3 ? std::atoi(argv[3]) : 227) * 1024;
  p.max_smem_per_block = smem;
  EmuLaunch l;
  l.max_smem_per_block = smem;
  p.total_q = p.total_k = s;
  run_fwd_sm80_emulated<HD, E>(p, l);
  if (!std::isfinite(lse[0])) return 1;
#ifdef PERF_COUNTS_BWD
  if (argc <= 4 || std::string(argv[4]) != "bwd") return 0;
  // The backward of the same problem: dO random, every gradient and workspace as api.cpp allocates them.
  std::vector<E> dout(s * h * d), dq(s * h * d), dk(s * h * d), dv(s * h * d);
  for (auto& x : dout) x = E(n(g));
  std::vector<float> dq_accum(size_t(s) * h * d), dk_accum(size_t(s) * h * d), dv_accum(size_t(s) * h * d),
      delta(h * s), dsink_rows(h * s);
  BwdParams b;
  static_cast<AttnParams&>(b) = static_cast<AttnParams const&>(p);
  b.out = o.data(); b.dout = dout.data(); b.lse = lse.data(); b.dq = dq.data(); b.dk = dk.data(); b.dv = dv.data();
  b.dq_batch_stride = b.dk_batch_stride = b.dv_batch_stride = int64_t(s) * h * d;
  b.dq_row_stride = b.dk_row_stride = b.dv_row_stride = h * d;
  b.dq_head_stride = b.dk_head_stride = b.dv_head_stride = d;
  b.dq_accum = dq_accum.data(); b.dk_accum = dk_accum.data(); b.dv_accum = dv_accum.data();
  b.delta = delta.data(); b.dsink_rows = dsink_rows.data();
  run_bwd_sm80_emulated<HD, E>(b, l);
  return std::isfinite(float(dq[0])) ? 0 : 1;
#else
  return 0;
#endif
}
