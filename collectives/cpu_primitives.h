// CPU primitives of the shared-memory transports (internal to collectives/; not installed):
// the threads backend (collectives/threads/) and the ucx backend's shared-memory channel and
// worker (collectives/ucx/) wait for their peers and move bytes with these.
//
//   const int64_t start = NowNs();
//   while (peer_word.load(std::memory_order_acquire) != expected) {
//     CpuRelax();                                // a pause between looks at the peer's word
//     if (NowNs() - start > kSpinNs) break;      // then yield, then sleep
//   }
//   StreamCopy(peer_out, chunk, chunk_bytes);    // bypasses the cache: data nobody here reads next
//   StreamFence();                               // before the store that tells the peer
//
// Each transport keeps its own spin counts and thresholds next to the code that uses them
// (they were measured separately); only the primitives live here.
#ifndef DTENSOR_COLLECTIVES_CPU_PRIMITIVES_H_
#define DTENSOR_COLLECTIVES_CPU_PRIMITIVES_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dtensor::internal {

// The steady clock in nanoseconds (an arbitrary epoch: for differences and deadlines).
inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A spin-wait hint between two looks at a word another thread or process writes (x86 pause,
// arm64 yield; nothing elsewhere). Not a fence: the looks themselves are atomic loads.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// dst = src, `bytes` bytes (none when bytes <= 0), with streaming (non-temporal) stores on
// x86-64: plain stores up to 16-byte alignment of dst and for the tail, 64 bytes of streaming
// stores per round in between; a plain memcpy elsewhere. Streaming stores are weakly ordered:
// the caller calls StreamFence() before it publishes what it copied.
inline void StreamCopy(char* dst, const char* src, int64_t bytes) {
  if (bytes <= 0) return;
  size_t n = static_cast<size_t>(bytes);
#if defined(__x86_64__)
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Orders the streaming stores before the stores that follow (x86-64 sfence; nothing elsewhere,
// where StreamCopy stores plainly).
inline void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Whether an elementwise loop that reads srcs[j][i] and writes dst[i] should run from the end.
// A load whose address matches a store still on its way out in the low 12 bits waits for it
// (4K aliasing): with the destination a few lines ahead of a source, modulo 4 KiB, every load
// of a forward loop waits, and a few lines behind does the same to a backward loop. This picks
// the direction whose near misses are fewer and farther; in place (the same address) costs
// neither. (This VM's AMD EPYC, 8192 floats from 2 sources: forward 1.55 / 1.20 / 1.09 / 1.00
// us with the destination 64 / 128 / 192 / 256 bytes ahead of a source, 0.92 from 320 on or
// behind; backward the mirror image. The ranks' tensors come from one allocator, so their
// offsets within a page differ by small multiples of 64 bytes.)
inline bool RunBackwards(const void* dst, const void* const* srcs, size_t nsrcs) {
  constexpr int64_t kPage = 4096, kNear = 512;
  int64_t forward = 0, backward = 0;
  for (size_t j = 0; j < nsrcs; ++j) {
    const int64_t ahead =
        static_cast<int64_t>((reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(srcs[j])) % kPage);
    if (ahead > 0 && ahead < kNear) forward += kNear - ahead;
    if (ahead > kPage - kNear) backward += kNear - (kPage - ahead);
  }
  return backward < forward;
}

// Calls block(i) for i = 0, 8, 16, ... while i + 8 <= n and one(i) for the rest, forward or
// (backwards) in the opposite order, the rest first: for elementwise loops that load a block
// of 8 from every source before storing it (in place safe either way; see RunBackwards).
template <typename Block, typename One>
inline void ForEachBlockOf8(int64_t n, bool backwards, Block&& block, One&& one) {
  const int64_t whole = n - n % 8;
  if (!backwards) {
    for (int64_t i = 0; i < whole; i += 8) block(i);
    for (int64_t i = whole; i < n; ++i) one(i);
    return;
  }
  for (int64_t i = n; i-- > whole;) one(i);
  for (int64_t i = whole; i > 0;) {
    i -= 8;
    block(i);
  }
}

// dst[i] = store(fold(i)) for i in [0, n): 8 folds (each reading srcs[j][i], accumulating in
// A) before their 8 stores, which compilers turn into whole vectors and which makes dst == a
// source safe, in the direction RunBackwards picks.
template <typename A, typename T, typename Fold, typename Store>
inline void StoreFoldsInBlocksOf8(T* dst, const void* const* srcs, size_t nsrcs, int64_t n, Fold&& fold,
                                  Store&& store) {
  ForEachBlockOf8(
      n, RunBackwards(dst, srcs, nsrcs),
      [&](int64_t i) {
        A v[8];
        for (int k = 0; k < 8; ++k) v[k] = fold(i + k);
        for (int k = 0; k < 8; ++k) dst[i + k] = store(v[k]);
      },
      [&](int64_t i) { dst[i] = store(fold(i)); });
}

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_CPU_PRIMITIVES_H_
