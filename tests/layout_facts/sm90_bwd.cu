// sm90_bwd.cu: the layout facts the sm90 backward relies on, evaluated on the host (CuTe layouts are host code),
// so they are checked without a GPU (docs/DESIGN.md section 6). tests/test_sm90_layouts.py compiles and runs it.
// Prints one line per fact and head dim, "ok" or what broke; exits 1 when anything broke. With --mutant it checks
// four plausible kernel bugs instead (two views built in the untransposed order, the S^T registers regrouped
// into k16 blocks from the wrong mode, and MN-major tiles under the 16-byte tail stores), each of which must be
// reported broken: the checks can fail.
#include <cstdio>
#include <string>
#include <type_traits>

#include "sm90/bwd_traits.h"
#include "sm90/wgmma_utils.cuh"

using namespace cute;
using namespace sinkattn::sm90;

static int failures = 0;

// A plausible bug in acc_as_a_operand: the k16 blocks' two n8 halves taken from the wrong mode.
template <class L>
constexpr auto acc_as_a_operand_mutant(L const& l) {
  auto v = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 1>(v)), get<1>(l), make_layout(get<2, 0>(v), get<2>(l)));
}

static void report(char const* fact, int hd, int bad, char const* first) {
  std::printf("hd%d %s: %s%s\n", hd, fact, bad ? "FAIL " : "ok", bad ? first : "");
  failures += bad != 0;
}

template <int kHeadDim, bool kMutant>
void check() {
  using Kt = BwdTraits<BwdTileOf<kHeadDim>, cutlass::bfloat16_t>;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN;
  using Untransposed_dSt = decltype(composition(typename Kt::SmemLayoutdS{},
      make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_1, _2, _3>{})));
  using Untransposed_Kt = decltype(composition(typename Kt::SmemLayoutKV{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_1, _2>{})));
  using LayoutdSt = std::conditional_t<kMutant, Untransposed_dSt, typename Kt::SmemLayoutdSt>;
  using LayoutKt = std::conditional_t<kMutant, Untransposed_Kt, typename Kt::SmemLayoutKt>;
  char first[256] = "";
  int bad = 0;
  auto fail = [&](char const* fmt, int a, int b, int c, int d) {
    if (bad++ == 0) std::snprintf(first, sizeof first, fmt, a, b, c, d);
  };

  // 1. The transposed shared-memory views address the same bytes as the tiles TMA writes.
  bad = 0;
  for (int s = 0; s < Kt::kStages; ++s)
    for (int i = 0; i < kBlockM; ++i)
      for (int c = 0; c < kHeadDim; ++c)
        if (typename Kt::SmemLayoutQt{}(c, i, s) != typename Kt::SmemLayoutQ{}(i, c, s)) fail("Qt(%d, %d, %d) %d", c, i, s, 0);
  report("Q^T / dO^T views (B of dK, dV) are Q / dO", kHeadDim, bad, first);
  bad = 0;
  for (int j = 0; j < kBlockN; ++j)
    for (int c = 0; c < kHeadDim; ++c)
      if (LayoutKt{}(c, j) != typename Kt::SmemLayoutKV{}(j, c)) fail("Kt(%d, %d) %d %d", c, j, 0, 0);
  report("K^T view (B of dQ) is K", kHeadDim, bad, first);
  bad = 0;
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < kBlockN; ++j)
      for (int i = 0; i < kBlockM; ++i)
        if (LayoutdSt{}(j, i, b) != typename Kt::SmemLayoutdS{}(i, j, b)) fail("dSt(%d, %d, %d) %d", j, i, b, 0);
  report("dS^T view (what the consumers write) is dS (A of dQ)", kHeadDim, bad, first);
  // The varlen tail zeroing (sm90/smem_utils.cuh zero_tail_rows) stores 16 bytes per 8 columns from a multiple
  // of 8: those 8 elements must be adjacent in shared memory, the first 16-byte aligned, in Q / dO (every stage)
  // and K / V. The mutant asks it of the MN-major layout of the same shape (rows contiguous), which breaks it.
  {
    using Atom = std::conditional_t<kMutant, GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>,
                                    GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>>;
    using LayoutQ = decltype(tile_to_shape(Atom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<Kt::kStages>>{}));
    using LayoutKV = decltype(tile_to_shape(Atom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    static_assert(kMutant || (std::is_same_v<LayoutQ, typename Kt::SmemLayoutQ> &&
                              std::is_same_v<LayoutKV, typename Kt::SmemLayoutKV>));
    bad = 0;
    for (int s = 0; s < Kt::kStages; ++s)
      for (int i = 0; i < kBlockM; ++i)
        for (int c = 0; c < kHeadDim; c += 8)
          for (int e = 0; e < 8; ++e)
            if (LayoutQ{}(i, c + e, s) != LayoutQ{}(i, c, s) + e || LayoutQ{}(i, c, s) % 8) fail("Q(%d, %d + %d, %d)", i, c, e, s);
    for (int j = 0; j < kBlockN; ++j)
      for (int c = 0; c < kHeadDim; c += 8)
        for (int e = 0; e < 8; ++e)
          if (LayoutKV{}(j, c + e) != LayoutKV{}(j, c) + e || LayoutKV{}(j, c) % 8) fail("K(%d, %d + %d) %d", j, c, e, 0);
    report("8 columns from a multiple of 8 are one 16-byte chunk of Q, dO, K, V", kHeadDim, bad, first);
  }

  // 2. Accumulator facts, for each of the 256 consumer threads.
  typename Kt::TiledMmaSdP mma_sdp;
  typename Kt::TiledMmadKV mma_dkv;
  typename Kt::TiledMmadQ mma_dq;
  int bad_a = 0, bad_rows = 0, bad_cols = 0, bad_pairs = 0, bad_cover = 0;
  char first_a[256] = "", first_rc[256] = "";
  static int seen_s[256][256], seen_dq[256][256], seen_dk[256][256];
  for (int t = 0; t < 256; ++t) {
    auto thr_sdp = mma_sdp.get_thread_slice(t);
    auto thr_dkv = mma_dkv.get_thread_slice(t);
    auto thr_dq = mma_dq.get_thread_slice(t);
    // S^T (key, query) of each accumulator register, and the same registers read as dV's A operand (P^T): the
    // A fragment of thread t must hold the same (key, query) in the same register.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    auto cS_as_a = [&] {
      if constexpr (kMutant) return make_tensor(cS.data(), acc_as_a_operand_mutant(cS.layout()));
      else return make_tensor(cS.data(), acc_as_a_operand(cS.layout()));
    }();
    Tensor cA = thr_dkv.partition_A(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    if (size(cS_as_a) != size(cA)) {
      if (bad_a++ == 0) std::snprintf(first_a, sizeof first_a, "thread %d: %d registers vs %d", t, int(size(cS_as_a)), int(size(cA)));
    } else {
      for (int e = 0; e < size(cA); ++e) {
        auto x = cS_as_a(e), y = cA(e);
        if (get<0>(x) != get<0>(y) || get<1>(x) != get<1>(y)) {
          if (bad_a++ == 0)
            std::snprintf(first_a, sizeof first_a, "thread %d register %d: S^T (%d, %d), A operand (%d, %d)", t, e,
                          int(get<0>(x)), int(get<1>(x)), int(get<0>(y)), int(get<1>(y)));
        }
      }
    }
    // The element passes: row r of the rows x cols view is one key for every column, column c one query for
    // every row (the mask's per-key bounds, the LSE / delta per query), two rows per thread.
    Tensor rc = rowcol_view(cS);
    if (size<0>(rc) != 2) bad_rows++;
    for (int r = 0; r < size<0>(rc); ++r)
      for (int c = 0; c < size<1>(rc); ++c) {
        if (get<0>(rc(r, c)) != get<0>(rc(r, 0))) bad_rows++;
        if (get<1>(rc(r, c)) != get<1>(rc(0, c))) bad_cols++;
      }
    for (int e = 0; e < size(cS); ++e) seen_s[get<0>(cS(e))][get<1>(cS(e))]++;
    // dQ and dK / dV: registers e and e + 1 (e even) are columns c and c + 1 of one row (8-byte atomics / stores).
    Tensor cQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cK = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    for (int e = 0; e < size(cQ); e += 2)
      if (get<0>(cQ(e)) != get<0>(cQ(e + 1)) || get<1>(cQ(e)) + 1 != get<1>(cQ(e + 1)) || get<1>(cQ(e)) % 2) bad_pairs++;
    for (int e = 0; e < size(cK); e += 2)
      if (get<0>(cK(e)) != get<0>(cK(e + 1)) || get<1>(cK(e)) + 1 != get<1>(cK(e + 1)) || get<1>(cK(e)) % 2) bad_pairs++;
    for (int e = 0; e < size(cQ); ++e) seen_dq[get<0>(cQ(e))][get<1>(cQ(e))]++;
    for (int e = 0; e < size(cK); ++e) seen_dk[get<0>(cK(e))][get<1>(cK(e))]++;
  }
  report("S^T registers are the A operand of dV += P^T dO", kHeadDim, bad_a, first_a);
  // The consumers store dS^T registers e, e + 1 (e even) as one 4-byte word: they must be adjacent elements of
  // dS's shared memory, the first at an even offset, in both buffers, for every thread.
  {
    static cutlass::bfloat16_t ds_smem[cosize_v<typename Kt::SmemLayoutdS>];
    Tensor sdSt = make_tensor(make_smem_ptr(ds_smem), LayoutdSt{});
    int bad_w = 0;
    char first_w[256] = "";
    for (int t = 0; t < 256; ++t) {
      Tensor part = mma_sdp.get_thread_slice(t).partition_C(sdSt);
      for (int b = 0; b < 2; ++b) {
        Tensor pb = part(_, _, _, b);
        for (int e = 0; e < size(pb); e += 2) {
          long const o0 = &pb(e) - ds_smem, o1 = &pb(e + 1) - ds_smem;
          if (o0 % 2 != 0 || o1 != o0 + 1) {
            if (bad_w++ == 0)
              std::snprintf(first_w, sizeof first_w, "thread %d buffer %d register %d: offsets %ld, %ld", t, b, e, o0, o1);
          }
        }
      }
    }
    report("dS^T register pairs are one 4-byte word of dS", kHeadDim, bad_w, first_w);
  }
  std::snprintf(first_rc, sizeof first_rc, " (%d rows, %d columns off)", bad_rows, bad_cols);
  report("S^T rows are keys, columns queries", kHeadDim, bad_rows + bad_cols, first_rc);
  report("dQ, dK, dV register pairs are adjacent columns", kHeadDim, bad_pairs, "");
  for (int i = 0; i < kBlockN; ++i)
    for (int j = 0; j < kBlockM; ++j) bad_cover += seen_s[i][j] != 1;
  for (int i = 0; i < kBlockM; ++i)
    for (int c = 0; c < kHeadDim; ++c) bad_cover += seen_dq[i][c] != 1;
  for (int i = 0; i < kBlockN; ++i)
    for (int c = 0; c < kHeadDim; ++c) bad_cover += seen_dk[i][c] != 1;
  report("S^T, dQ, dK tiles covered once by the 256 threads", kHeadDim, bad_cover, "");
  for (auto* a : {&seen_s, &seen_dq, &seen_dk})
    for (auto& row : *a)
      for (int& v : row) v = 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--mutant") {
    check<64, true>();
    check<128, true>();
  } else {
    check<64, false>();
    check<128, false>();
  }
  return failures ? 1 : 0;
}
