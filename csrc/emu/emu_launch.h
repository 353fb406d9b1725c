// emu_launch.h: what a host-emulated launch takes besides the kernel params (no CuTe, no threads: api.cpp
// includes it).
#pragma once

namespace sinkattn {

struct EmuLaunch {
  int max_smem_per_block = 163 * 1024;  // picks the tile configuration, as the device's limit does on a GPU
  // The SMs a persistent sm90 grid is sized for (one CTA each): few, so that each CTA walks several tiles and its
  // stage rings wrap; odd, so that the tiles do not split evenly.
  int sm_count = 3;
};

}  // namespace sinkattn
