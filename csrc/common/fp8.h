// fp8.h: the FP8 KV-cache formats the sm80 decode kernels read (docs/DESIGN.md sections 1 and 4), decoded exactly
// on the GPU and, unchanged, on the host (the emulation and a host entry that checks all 256 codes of each format
// against torch). No CuTe, no CUDA intrinsics.
//
// Every value of both formats is exact in bf16 and fp16, so the decode is exact; it goes through normal floats
// only: the GPU build compiles with --use_fast_math, which flushes float subnormals, so the subnormal codes
// (exponent field 0) take an integer times a power of two instead of a float with a subnormal bit pattern.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/defs.h"

namespace sinkattn {

// FwdParams::kv_fp8: what the caches hold (0: q's dtype, no FP8).
enum Fp8Format : int { kFp8None = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };

SA_HOST_DEVICE float fp8_bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinity, NaN is S.1111.111 (0x7f, 0xff).
// Normal codes: the exponent moves to float's bias (+120) with one add; subnormals (exponent 0): m * 2^-9.
SA_HOST_DEVICE float e4m3_to_float(uint32_t x) {
  uint32_t const mag = x & 0x7fu;
  float v = mag < 8u ? float(mag) * 0.001953125f : fp8_bits_to_float((mag << 20) + (120u << 23));
  if (mag == 0x7fu) v = NAN;
  return (x & 0x80u) ? -v : v;
}

// float8_e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits; S.11111.00 is infinity, S.11111.xx NaN. It is the
// top byte of an fp16 (e5m2_fp16_bits); as a float: the exponent moves by +112, subnormals are m * 2^-16.
SA_HOST_DEVICE float e5m2_to_float(uint32_t x) {
  uint32_t const mag = x & 0x7fu;
  float v = mag < 4u ? float(mag) * 1.52587890625e-05f : fp8_bits_to_float((mag << 21) + (112u << 23));
  if (mag >= 0x7cu) v = mag == 0x7cu ? INFINITY : NAN;
  return (x & 0x80u) ? -v : v;
}

// NaN by its bits (the GPU build's --use_fast_math may fold x != x away).
SA_HOST_DEVICE bool float_is_nan(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

SA_HOST_DEVICE uint16_t e5m2_fp16_bits(uint32_t x) { return uint16_t((x & 0xffu) << 8); }

SA_HOST_DEVICE float fp8_to_float(uint32_t x, int format) {
  return format == kFp8E5M2 ? e5m2_to_float(x) : e4m3_to_float(x);
}

}  // namespace sinkattn
