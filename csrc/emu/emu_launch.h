// emu_launch.h: what a host-emulated launch takes besides the kernel params (no CuTe, no threads: api.cpp
// includes it).
#pragma once

namespace sinkattn {

struct EmuLaunch {
  int max_smem_per_block = 163 * 1024;  // picks the tile configuration, as the device's limit does on a GPU
};

}  // namespace sinkattn
