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

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_CPU_PRIMITIVES_H_
