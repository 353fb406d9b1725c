// Every answer of the sm80 tile rules (fwd_tiles.h choose_fwd_tile, choose_fwd_fp8_tile; bwd_tiles.h
// choose_bwd_tile) over the shapes and shared-memory limits a device can have is a tile its head dim's list compiles,
// so with_tile_in runs exactly one kernel for it; and a tile outside the list throws instead of running nothing.
// Also which answers are prefill tiles (FwdTile::prefill: softcap compiled in or out, the lazy rebase): every answer
// for more than 64 rows without split-KV; at head dims 64 and 128 no other answer, and no FP8 tile.
// Host code, no CuTe: tests/test_sm80_tile_lists.py compiles and runs it. Prints one line per failure and exits 1.
#include <cstdio>
#include <stdexcept>

#include "sm80/bwd_tiles.h"
#include "sm80/fwd_tiles.h"

using namespace sinkattn::sm80;

static int failures = 0;

template <class Value>
static int runs(Value const& t, auto with) {
  int calls = 0;
  bool same = true;
  try {
    with(t, [&]<class Tile>() {
      ++calls;
      same = same && Tile::tile == t;
    });
  } catch (std::logic_error const&) {
    return -1;
  }
  return same ? calls : -2;
}

template <int kHeadDim>
static void check_head_dim() {
  auto fwd = [](FwdTile const& t, auto f) { with_fwd_tile<kHeadDim>(t, f); };
  auto fp8 = [](FwdTile const& t, auto f) { with_fwd_fp8_tile<kHeadDim>(t, f); };
  auto bwd = [](BwdTile const& t, auto f) { with_bwd_tile<kHeadDim>(t, f); };
  long long const rows[] = {1, 8, 16, 17, 24, 32, 33, 48, 64, 65, 100, 128, 129, 4096, 1 << 20};
  // every per-block limit from 48 KB up to an sm90's 227 KB (and past it), 1 KB apart
  for (int kb = 48; kb <= 240; ++kb) {
    int const smem = kb * 1024;
    for (long long r : rows) {
      for (bool split : {false, true}) {
        FwdTile const t = choose_fwd_tile(kHeadDim, FwdShape{r, split}, smem);
        if (t.smem_bytes() > smem) continue;  // below the head dim's smallest tile nothing runs (the registry says so)
        if (int const n = runs(t, fwd); n != 1) {
          std::printf("FAIL fwd hd%d rows %lld split %d %d KB: %d kernels ran\n", kHeadDim, r, int(split), kb, n);
          ++failures;
        }
        // (hd256 has no decode tile below 136 KB, nor one for 17-64 rows: those run a prefill tile)
        bool const want_prefill = r > 64 && !split, no_prefill = !want_prefill && kHeadDim != 256;
        if ((want_prefill && !t.prefill) || (no_prefill && t.prefill)) {
          std::printf("FAIL fwd hd%d rows %lld split %d %d KB: prefill %d\n", kHeadDim, r, int(split), kb, t.prefill);
          ++failures;
        }
      }
      if constexpr (kHeadDim != 256) {
        FwdTile const t = choose_fwd_fp8_tile(kHeadDim, r, smem);
        if (fwd_fp8_smem_bytes(t) <= smem)
          if (int const n = runs(t, fp8); n != 1)
            std::printf("FAIL fp8 hd%d rows %lld %d KB: %d kernels ran\n", kHeadDim, r, kb, n), ++failures;
        if (t.prefill) std::printf("FAIL fp8 hd%d rows %lld %d KB: a prefill tile\n", kHeadDim, r, kb), ++failures;
      }
    }
    for (bool softcap : {false, true}) {
      BwdTile const t = choose_bwd_tile(kHeadDim, smem, softcap);
      if (t.smem_bytes() > smem) continue;
      if (int const n = runs(t, bwd); n != 1)
        std::printf("FAIL bwd hd%d softcap %d %d KB: %d kernels ran\n", kHeadDim, int(softcap), kb, n), ++failures;
    }
  }
}

int main() {
  check_head_dim<64>();
  check_head_dim<128>();
  check_head_dim<256>();
  // A tile of another head dim's list is in none of this one's: the call throws, nothing runs.
  auto fwd64 = [](FwdTile const& t, auto f) { with_fwd_tile<64>(t, f); };
  if (int const n = runs(fwd_tiles::Hd128Rows::tile, fwd64); n != -1)
    std::printf("FAIL a tile outside hd64's list: %d kernels ran, no throw\n", n), ++failures;
  auto bwd64 = [](BwdTile const& t, auto f) { with_bwd_tile<64>(t, f); };
  if (int const n = runs(bwd_tiles::Hd256::tile, bwd64); n != -1)
    std::printf("FAIL a backward tile outside hd64's list: %d kernels ran, no throw\n", n), ++failures;
  std::printf("%s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
