// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
// a counter-based generator. The same (key, counter) gives the same four 32-bit words on
// the host and on a GPU, which is what makes seeded initialisation independent of device,
// rank and sharding. Shared by the CPU and CUDA kernels; header-only.
#ifndef DTENSOR_KERNELS_PHILOX_H_
#define DTENSOR_KERNELS_PHILOX_H_

#include <cmath>
#include <cstdint>

#include "dtensor/kernels/host_device.h"

namespace dtensor::internal {

struct Philox4 {
  uint32_t x[4];
};

DT_HOST_DEVICE void MulHiLo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Ten rounds of Philox4x32 on `counter` with the 64-bit `key`.
DT_HOST_DEVICE Philox4 Philox4x32_10(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo32(0xD2511F53u, c0, &hi0, &lo0);
    MulHiLo32(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n1 = lo1;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    const uint32_t n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The value of element `index` of a tensor filled from `seed`. Uniform values lie in
// [a, b); normal values have mean a and standard deviation b (Box-Muller in double precision,
// so the host and the GPU agree to the last float bit in all but vanishingly rare cases).
DT_HOST_DEVICE double RandomUniformAt(uint64_t seed, uint64_t index, double low, double high) {
  const Philox4 r = Philox4x32_10(index, 0, seed);
  const double u = static_cast<double>(r.x[0]) * (1.0 / 4294967296.0);  // [0, 1)
  return low + (high - low) * u;
}

DT_HOST_DEVICE double RandomNormalAt(uint64_t seed, uint64_t index, double mean, double stddev) {
  const Philox4 r = Philox4x32_10(index, 0, seed);
  const double u1 = (static_cast<double>(r.x[0]) + 1.0) * (1.0 / 4294967296.0);  // (0, 1]
  const double u2 = static_cast<double>(r.x[1]) * (1.0 / 4294967296.0);          // [0, 1)
  return mean + stddev * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_PHILOX_H_
