// perf_counts_harness.cpp: one sm80 forward (batch 1, one head, seqlen_q = seqlen_k = S, head dim HD, bf16) run
// on the CPU by the host emulation of the tree it is compiled against (csrc/emu/fwd_sm80_emu.h: the kernel's own
// body), built with gcov so that every source line of the kernel counts its executions on this problem.
// tools/perf_counts.sh builds and runs it; tools/perf_counts.py weighs the kernel's SASS blocks with the counts.
// No torch: the emulation headers need only CUTLASS/CuTe. A dense problem with an interior of whole key blocks:
// what the model's measured prefill rows run.
#include "emu/fwd_sm80_emu.h"

#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  using namespace sinkattn;
  using E = cutlass::bfloat16_t;
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
  run_fwd_sm80_emulated<HD, E>(p, l);
  return std::isfinite(lse[0]) ? 0 : 1;
}
