// Rank program for tests/collectives/ucx_test.cc, run under dtrun:
//   ucx_test_child battery     every collective, dtype and a range of sizes (odd, empty, above
//                              the one-hop / ring switch, multi-chunk), AllToAllBlocks of
//                              strided views, checked against
//                              references computed here from every rank's (reproducible) data;
//                              prints each mismatch and exits 1 if there was one.
//   ucx_test_child battery-mixed SETTING   the battery with SETTING on odd ranks only: an
//                              environment variable (NAME=VALUE, e.g. DTENSOR_UCX_CMA=0) or
//                              one-cpu (this process moves onto the lowest CPU of dtrun's
//                              affinity, where dtrun binds rank 0: with dtrun confined to two
//                              CPUs, ranks 0 and 1 then share one). Every input to
//                              a path choice must be agreed, or ranks take different paths and
//                              deadlock or read garbage.
//   ucx_test_child setup       makes the world communicator and does a Barrier (with
//                              DTENSOR_UCX_INFO=1 rank 0 prints the agreed paths);
//   ucx_test_child setup-mixed SETTING   the same with SETTING on odd ranks only.
//   ucx_test_child listening   makes the world communicator, does an AllReduce, and prints
//                              every TCP socket this process listens on ("listening ADDR:PORT",
//                              read from /proc/net/tcp and tcp6 for this process's socket fds),
//                              then "listening done".
//   ucx_test_child dead-peer   the last rank exits while the others are inside an AllReduce;
//                              they must get Unavailable (printed), then exit 0.
//   ucx_test_child timeout     rank 1 never joins an AllReduce; the others must get
//                              DeadlineExceeded within DTENSOR_TIMEOUT_S (printed), then exit 0.
//   ucx_test_child debug-mismatch   (under DTENSOR_DEBUG=1) rank 1 calls AllGather while the
//                              others call AllReduce; every rank must get InvalidArgument
//                              naming both calls (printed), and a matching call must work after.
//   ucx_test_child zero-copy on|off   AllReduce, ReduceScatter, AllGather and Broadcast of
//                              12 MiB tensors; with on, every rank's blocks must be shared and
//                              mapped by the peers that read or write them (seen in
//                              /proc/self/maps; broadcast readers map only the root's), and once
//                              a rank gives its blocks back (EmptyCache) the peers must drop
//                              those mappings within 32 more steps; a round has the odd
//                              ranks' buffers in private memory (split agreement past 2 MiB
//                              blocks); the last one's blocks, given back, must be unmapped
//                              within 32 small calls (no single-copy step). With off (DTENSOR_UCX_ZERO_COPY=0), nothing
//                              is shared or mapped. Results are checked in every round.
//   ucx_test_child size-mismatch   an AllGather whose ranks disagree on the block size (a user
//                              error, no DTENSOR_DEBUG): rank 0 reads a larger block than
//                              rank 1 holds and must get InvalidArgument naming both sizes
//                              (not bytes past rank 1's buffer), the others an error; all
//                              print it and exit 0 then.
//   ucx_test_child late-ranks  each round one rank comes 3 ms late, so the others sleep on
//                              its futex word: AllReduce, Broadcast (from it, from another),
//                              AllGather, Barrier, checked (the sleep and wake-up path).
//   ucx_test_child bench       not a test: timings.
//   ucx_test_child bench-blocks   not a test: AllToAllBlocks of S(0) -> S(1) column blocks
//                              beside the default's pack + AllToAll and a plain AllToAll.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/collectives/ucx/ucx_communicator.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/allocator.h"
#include "dtensor/tensor/shared_cpu_block.h"
#include "dtensor/tensor/status.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {
namespace {

int g_failures = 0;
int g_checks = 0;

void Fail(const std::string& what) {
  ++g_failures;
  if (g_failures <= 30) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

void ExpectOk(const absl::Status& s, const std::string& what) {
  ++g_checks;
  if (!s.ok()) Fail(absl::StrCat(what, ": ", s.ToString()));
}

// Reproducible data: rank r's element i. Floats are multiples of 1/4 in [-2, 2] (exact in
// every dtype, so sums of a few are exact); products use {-1, 1/2, 1, 2}.
template <typename T>
T Gen(int rank, int64_t i, int seed, bool for_product) {
  const int64_t h = (rank * 131 + i * 7 + seed * 17 + (i * i) % 13) % 17;
  if constexpr (std::is_same_v<T, bool>) {
    return ((h + rank) % 3) != 0;
  } else if constexpr (std::is_integral_v<T>) {
    if (for_product) return static_cast<T>(h % 5 == 0 ? -(h + 1) * 1009 : h * 997 + 1);
    return static_cast<T>((rank * 31 + i * 13 + seed) % 1000 - 500);
  } else {
    static const float kProd[4] = {-1.0f, 0.5f, 1.0f, 2.0f};
    const float v = for_product ? kProd[h % 4] : static_cast<float>(h - 8) * 0.25f;
    return T(v);
  }
}

template <typename T>
double AsDouble(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? 1 : 0;
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

// The reduction of vals (one per rank, in rank order).
template <typename T>
T RefReduce(CommReduceOp op, const std::vector<T>& vals) {
  const int p = static_cast<int>(vals.size());
  if constexpr (std::is_same_v<T, bool>) {
    bool any = false, all = true;
    for (bool v : vals) any |= v, all &= v;
    return (op == CommReduceOp::kMin || op == CommReduceOp::kProduct) ? all : any;
  } else if constexpr (std::is_integral_v<T>) {
    uint64_t sum = 0, prod = 1;
    T mx = vals[0], mn = vals[0];
    for (T v : vals) {
      sum += static_cast<uint64_t>(static_cast<int64_t>(v));
      prod *= static_cast<uint64_t>(static_cast<int64_t>(v));
      mx = v > mx ? v : mx;
      mn = v < mn ? v : mn;
    }
    switch (op) {
      case CommReduceOp::kSum:
        return static_cast<T>(sum);
      case CommReduceOp::kAvg:
        return static_cast<T>(static_cast<T>(sum) / static_cast<T>(p));
      case CommReduceOp::kMax:
        return mx;
      case CommReduceOp::kMin:
        return mn;
      case CommReduceOp::kProduct:
        return static_cast<T>(prod);
    }
    return T{};
  } else {
    double sum = 0, prod = 1, mx = -INFINITY, mn = INFINITY;
    bool nan = false;
    for (T v : vals) {
      const double d = AsDouble(v);
      nan |= std::isnan(d);
      sum += d;
      prod *= d;
      mx = std::max(mx, d);
      mn = std::min(mn, d);
    }
    float r = 0;
    switch (op) {
      case CommReduceOp::kSum:
        r = static_cast<float>(sum);
        break;
      case CommReduceOp::kAvg:
        r = static_cast<float>(sum) / static_cast<float>(p);
        break;
      case CommReduceOp::kMax:
        r = nan ? NAN : static_cast<float>(mx);
        break;
      case CommReduceOp::kMin:
        r = nan ? NAN : static_cast<float>(mn);
        break;
      case CommReduceOp::kProduct:
        r = static_cast<float>(prod);
        break;
    }
    return T(r);
  }
}

template <typename T>
bool Same(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return a == b;
  } else {
    const double x = AsDouble(a), y = AsDouble(b);
    return (std::isnan(x) && std::isnan(y)) || x == y;
  }
}

template <typename T>
void ExpectData(const Tensor& t, const std::vector<T>& want, const std::string& what) {
  ++g_checks;
  const T* got = t.data<T>();
  for (size_t i = 0; i < want.size(); ++i) {
    if (!Same(got[i], want[i])) {
      Fail(absl::StrCat(what, ": element ", i, " of ", want.size(), " is ", AsDouble(got[i]), ", expected ",
                        AsDouble(want[i])));
      return;
    }
  }
}

template <typename T>
Tensor Make(int64_t n) {
  return *Tensor::Empty({n}, DTypeOf<T>::value);
}

template <typename T>
Tensor Fill(int rank, int64_t n, int seed, bool prod, int nan_at = -1) {
  Tensor t = Make<T>(n);
  for (int64_t i = 0; i < n; ++i) t.data<T>()[i] = Gen<T>(rank, i, seed, prod);
  if constexpr (!std::is_integral_v<T>) {
    if (nan_at >= 0 && nan_at < n) t.data<T>()[nan_at] = T(NAN);
  }
  return t;
}

// Elements [begin, begin + n) of every rank's Fill, reduced.
template <typename T>
std::vector<T> RefReduced(CommReduceOp op, int p, int64_t begin, int64_t n, int seed, bool prod, int nan_rank,
                          int nan_at) {
  std::vector<T> out(static_cast<size_t>(n));
  std::vector<T> vals(static_cast<size_t>(p));
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < p; ++j) {
      T v = Gen<T>(j, begin + i, seed, prod);
      if constexpr (!std::is_integral_v<T>) {
        if (j == nan_rank && begin + i == nan_at) v = T(NAN);
      }
      vals[static_cast<size_t>(j)] = v;
    }
    out[static_cast<size_t>(i)] = RefReduce(op, vals);
  }
  return out;
}

std::vector<int64_t> ChunkCounts(int64_t total, int p) {  // torch.chunk: ceil-sized, the tail short or empty
  const int64_t c = (total + p - 1) / p;
  std::vector<int64_t> counts;
  for (int j = 0; j < p; ++j) counts.push_back(std::max<int64_t>(0, std::min(c, total - j * c)));
  return counts;
}

// The world communicator under dtrun (rendezvous within `timeout`), or nullptr after printing
// why (the mode then exits 2).
std::unique_ptr<Communicator> MakeWorld(absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MakeUcxCommunicatorFromEnv(timeout);
  if (!comm.ok()) {
    std::fprintf(stderr, "MakeUcxCommunicatorFromEnv: %s\n", comm.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(comm);
}

template <typename T>
void Battery(Communicator& comm, const char* tname) {
  const int p = comm.size(), r = comm.rank();
  const bool is_bool = std::is_same_v<T, bool>;
  // 1500007 floats: blocks past the single-copy reduction's limit (the slots + written result).
  const std::vector<int64_t> sizes = {0, 1, 3, 17, 127, 1000, 20000, 300001, 1500007};
  std::vector<CommReduceOp> ops = {CommReduceOp::kSum, CommReduceOp::kAvg, CommReduceOp::kMax, CommReduceOp::kMin,
                                   CommReduceOp::kProduct};
  if (is_bool) ops = {CommReduceOp::kSum, CommReduceOp::kMin};
  int seed = 0;
  for (int64_t n : sizes) {
    if (n > 20000 && (is_bool || std::is_same_v<T, int64_t>)) continue;
    if (n > 300001 && !std::is_same_v<T, float>) continue;
    const std::string at = absl::StrCat(tname, " n=", n, " p=", p, " rank ", r);
    for (CommReduceOp op : ops) {
      ++seed;
      const bool prod = op == CommReduceOp::kProduct;
      // NaN propagation on max / min: rank p-1 puts a NaN at element 1.
      const int nan_rank = (op == CommReduceOp::kMax || op == CommReduceOp::kMin) ? p - 1 : -1;
      const int nan_at = 1;
      Tensor in = Fill<T>(r, n, seed, prod, r == nan_rank ? nan_at : -1);
      Tensor out = Make<T>(n);
      const auto want = RefReduced<T>(op, p, 0, n, seed, prod, nan_rank, nan_at);
      ExpectOk(comm.AllReduce(in, out, op), absl::StrCat("AllReduce ", CommReduceOpName(op), " ", at));
      ExpectData(out, want, absl::StrCat("AllReduce ", CommReduceOpName(op), " ", at));
      ExpectOk(comm.AllReduce(in, in, op), absl::StrCat("AllReduce in place ", CommReduceOpName(op), " ", at));
      ExpectData(in, want, absl::StrCat("AllReduce in place ", CommReduceOpName(op), " ", at));
      if (n > 20000 && op != CommReduceOp::kSum) continue;
      // ReduceScatter: input [p * n], block r.
      Tensor rs_in = Fill<T>(r, p * n, seed, prod, r == nan_rank ? nan_at : -1);
      Tensor rs_out = Make<T>(n);
      const auto rs_want = RefReduced<T>(op, p, r * n, n, seed, prod, nan_rank, nan_at);
      ExpectOk(comm.ReduceScatter(rs_in, rs_out, op), absl::StrCat("ReduceScatter ", CommReduceOpName(op), " ", at));
      ExpectData(rs_out, rs_want, absl::StrCat("ReduceScatter ", CommReduceOpName(op), " ", at));
      Tensor own = *rs_in.Narrow(0, r * n, n);
      ExpectOk(comm.ReduceScatter(rs_in, own, op), absl::StrCat("ReduceScatter in place ", at));
      ExpectData(own, rs_want, absl::StrCat("ReduceScatter in place ", CommReduceOpName(op), " ", at));
      // ReduceScatterV over torch.chunk counts of p * n + 1 elements.
      const std::vector<int64_t> counts = ChunkCounts(p * n + 1, p);
      int64_t prefix = 0;
      for (int j = 0; j < r; ++j) prefix += counts[static_cast<size_t>(j)];
      Tensor rsv_in = Fill<T>(r, p * n + 1, seed, prod);
      Tensor rsv_out = Make<T>(counts[static_cast<size_t>(r)]);
      ExpectOk(comm.ReduceScatterV(rsv_in, rsv_out, counts, op), absl::StrCat("ReduceScatterV ", at));
      ExpectData(rsv_out, RefReduced<T>(op, p, prefix, counts[static_cast<size_t>(r)], seed, prod, -1, -1),
                 absl::StrCat("ReduceScatterV ", CommReduceOpName(op), " ", at));
    }
    ++seed;
    // AllGather (and in place: input is this rank's block of the output).
    {
      Tensor in = Fill<T>(r, n, seed, false);
      Tensor out = Make<T>(p * n);
      std::vector<T> want;
      for (int j = 0; j < p; ++j) {
        for (int64_t i = 0; i < n; ++i) want.push_back(Gen<T>(j, i, seed, false));
      }
      ExpectOk(comm.AllGather(in, out), absl::StrCat("AllGather ", at));
      ExpectData(out, want, absl::StrCat("AllGather ", at));
      Tensor out2 = Make<T>(p * n);
      Tensor mine = *out2.Narrow(0, r * n, n);
      if (n > 0) std::memcpy(mine.raw_data(), in.raw_data(), in.nbytes());
      ExpectOk(comm.AllGather(mine, out2), absl::StrCat("AllGather in place ", at));
      ExpectData(out2, want, absl::StrCat("AllGather in place ", at));
    }
    // AllGatherV over torch.chunk counts of p * n + 1 elements (the tail may be empty).
    {
      const std::vector<int64_t> counts = ChunkCounts(p * n + 1, p);
      Tensor in = Fill<T>(r, counts[static_cast<size_t>(r)], seed, false);
      Tensor out = Make<T>(p * n + 1);
      std::vector<T> want;
      for (int j = 0; j < p; ++j) {
        for (int64_t i = 0; i < counts[static_cast<size_t>(j)]; ++i) want.push_back(Gen<T>(j, i, seed, false));
      }
      ExpectOk(comm.AllGatherV(in, out, counts), absl::StrCat("AllGatherV ", at));
      ExpectData(out, want, absl::StrCat("AllGatherV ", at));
    }
    // AllToAll: block j of rank r's input goes to rank j (and in place).
    {
      Tensor in = Fill<T>(r, p * n, seed, false);
      Tensor out = Make<T>(p * n);
      std::vector<T> want;
      for (int j = 0; j < p; ++j) {
        for (int64_t i = 0; i < n; ++i) want.push_back(Gen<T>(j, r * n + i, seed, false));
      }
      ExpectOk(comm.AllToAll(in, out), absl::StrCat("AllToAll ", at));
      ExpectData(out, want, absl::StrCat("AllToAll ", at));
      ExpectOk(comm.AllToAll(in, in), absl::StrCat("AllToAll in place ", at));
      ExpectData(in, want, absl::StrCat("AllToAll in place ", at));
    }
    // AllToAllV: rank i sends (i * 2 + j + n) % 5 * (n % 7 + 1) elements to rank j.
    {
      auto cnt = [&](int from, int to) { return static_cast<int64_t>((from * 2 + to + n) % 5 * (n % 7 + 1)); };
      std::vector<int64_t> sc, rc;
      for (int j = 0; j < p; ++j) sc.push_back(cnt(r, j)), rc.push_back(cnt(j, r));
      int64_t st = 0, rt = 0;
      for (int j = 0; j < p; ++j) st += sc[static_cast<size_t>(j)], rt += rc[static_cast<size_t>(j)];
      Tensor in = Fill<T>(r, st, seed, false);
      Tensor out = Make<T>(rt);
      std::vector<T> want;
      for (int j = 0; j < p; ++j) {
        int64_t off = 0;  // where rank j's block for r starts in j's input
        for (int k = 0; k < r; ++k) off += cnt(j, k);
        for (int64_t i = 0; i < cnt(j, r); ++i) want.push_back(Gen<T>(j, off + i, seed, false));
      }
      ExpectOk(comm.AllToAllV(in, out, sc, rc), absl::StrCat("AllToAllV ", at));
      ExpectData(out, want, absl::StrCat("AllToAllV ", at));
    }
    // Broadcast from every root.
    for (int root = 0; root < p; ++root) {
      Tensor t = Fill<T>(r, n, seed + root, false);
      std::vector<T> want;
      for (int64_t i = 0; i < n; ++i) want.push_back(Gen<T>(root, i, seed + root, false));
      ExpectOk(comm.Broadcast(t, root), absl::StrCat("Broadcast root ", root, " ", at));
      ExpectData(t, want, absl::StrCat("Broadcast root ", root, " ", at));
    }
  }
}

void PointToPoint(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  if (p == 1) return;
  for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{100000}, int64_t{1} << 20}) {
    // Everyone sends to the right first, then receives from the left (needs the async forms).
    Tensor out = Fill<float>(r, n, 7, false), in = Make<float>(n);
    auto send = comm.SendAsync(out, (r + 1) % p);
    auto recv = comm.RecvAsync(in, (r + p - 1) % p);
    ExpectOk(send.status(), "SendAsync");
    ExpectOk(recv.status(), "RecvAsync");
    if (send.ok() && recv.ok()) {
      ExpectOk((*recv)->Wait(), absl::StrCat("Recv n=", n));
      ExpectOk((*send)->Wait(), absl::StrCat("Send n=", n));
      std::vector<float> want;
      for (int64_t i = 0; i < n; ++i) want.push_back(Gen<float>((r + p - 1) % p, i, 7, false));
      ExpectData(in, want, absl::StrCat("Send/Recv n=", n, " rank ", r));
    }
  }
  // BatchSendRecv: every rank sends to every rank (itself too), sends listed first, with a
  // second batch posted before the first is waited for (messages of a pair match in order).
  for (int64_t n : {int64_t{0}, int64_t{3}, int64_t{70000}}) {
    std::vector<Tensor> got1, got2;
    std::vector<PeerOp> ops1, ops2;
    for (int j = 0; j < p; ++j) {
      ops1.push_back(PeerOp::Send(Fill<float>(r, n + r, 100 + j, false), j));
      ops2.push_back(PeerOp::Send(Fill<float>(r, n + r, 200 + j, false), j));
    }
    for (int j = 0; j < p; ++j) {
      got1.push_back(Make<float>(n + j));
      got2.push_back(Make<float>(n + j));
      ops1.push_back(PeerOp::Recv(got1.back(), j));
      ops2.push_back(PeerOp::Recv(got2.back(), j));
    }
    auto w1 = comm.BatchSendRecvAsync(ops1);
    auto w2 = comm.BatchSendRecvAsync(ops2);
    ExpectOk(w1.status(), "BatchSendRecvAsync 1");
    ExpectOk(w2.status(), "BatchSendRecvAsync 2");
    if (!w1.ok() || !w2.ok()) continue;
    ExpectOk((*w2)->Wait(), absl::StrCat("BatchSendRecv 2 n=", n));
    ExpectOk((*w1)->Wait(), absl::StrCat("BatchSendRecv 1 n=", n));
    for (int j = 0; j < p; ++j) {
      std::vector<float> want1, want2;
      for (int64_t i = 0; i < n + j; ++i) {
        want1.push_back(Gen<float>(j, i, 100 + r, false));
        want2.push_back(Gen<float>(j, i, 200 + r, false));
      }
      ExpectData(got1[static_cast<size_t>(j)], want1, absl::StrCat("BatchSendRecv 1 n=", n, " from ", j));
      ExpectData(got2[static_cast<size_t>(j)], want2, absl::StrCat("BatchSendRecv 2 n=", n, " from ", j));
    }
  }
  // Several messages between one pair match in order; blocking forms.
  if (p >= 2 && r < 2) {
    for (int k = 0; k < 3; ++k) {
      Tensor t = Make<int32_t>(4);
      if (r == 0) {
        for (int i = 0; i < 4; ++i) t.data<int32_t>()[i] = k * 10 + i;
        ExpectOk(comm.Send(t, 1), "Send in order");
      } else {
        ExpectOk(comm.Recv(t, 0), "Recv in order");
        ExpectData(t, std::vector<int32_t>{k * 10, k * 10 + 1, k * 10 + 2, k * 10 + 3}, "Send/Recv order");
      }
    }
  }
}

void SplitAndMisc(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  // Validation errors are local and leave the communicator usable.
  {
    Tensor a = Make<float>(4), b = Make<float>(5), c = Make<int32_t>(4);
    ++g_checks;
    if (comm.AllReduce(a, b, CommReduceOp::kSum).code() != absl::StatusCode::kInvalidArgument) Fail("AllReduce numel");
    ++g_checks;
    if (comm.AllReduce(a, c, CommReduceOp::kSum).code() != absl::StatusCode::kInvalidArgument) Fail("AllReduce dtype");
    ++g_checks;
    absl::Status s = comm.Broadcast(a, p);
    if (s.code() != absl::StatusCode::kInvalidArgument || s.message().find("root") == std::string_view::npos) {
      Fail(absl::StrCat("Broadcast root: ", s.ToString()));
    }
    Tensor bools = Make<bool>(2);
    ++g_checks;
    if (comm.AllReduce(bools, bools, CommReduceOp::kAvg).code() != absl::StatusCode::kInvalidArgument) {
      Fail("avg on bool");
    }
    Tensor t = *Tensor::Empty({4, 2}, DType::kFloat32);
    Tensor tt = *t.Transpose(0, 1);
    ++g_checks;
    if (comm.AllReduce(tt, tt, CommReduceOp::kSum).code() != absl::StatusCode::kInvalidArgument) {
      Fail("non-contiguous");
    }
    ++g_checks;
    if (comm.Send(a, r).code() != absl::StatusCode::kInvalidArgument) Fail("Send to self");
  }
  ExpectOk(comm.Barrier(), "Barrier");
  // Async collective.
  {
    Tensor x = Fill<float>(r, 33, 3, false), y = Make<float>(33);
    auto w = comm.AllReduceAsync(x, y, CommReduceOp::kSum);
    ExpectOk(w.status(), "AllReduceAsync");
    if (w.ok()) {
      ExpectOk((*w)->Wait(), "AllReduceAsync Wait");
      ExpectData(y, RefReduced<float>(CommReduceOp::kSum, p, 0, 33, 3, false, -1, -1), "AllReduceAsync");
    }
  }
  // Async collectives run on the comm thread in issue order: several in flight, then a
  // blocking one (which runs after them) and a barrier, then the waits; all right.
  {
    const int64_t n = 70000;  // past the one-hop sizes: rings / single copy
    Tensor a = Fill<float>(r, n, 5, false), ag = Make<float>(n * p);
    Tensor b = Fill<float>(r, n * p, 6, false), rs = Make<float>(n);
    Tensor c = Fill<float>(r, 40, 7, false), ar = Make<float>(40);
    auto w1 = comm.AllGatherAsync(a, ag);
    auto w2 = comm.ReduceScatterAsync(b, rs, CommReduceOp::kSum);
    ExpectOk(w1.status(), "AllGatherAsync");
    ExpectOk(w2.status(), "ReduceScatterAsync");
    ExpectOk(comm.AllReduce(c, ar, CommReduceOp::kSum), "AllReduce behind two async ones");
    ExpectOk(comm.Barrier(), "Barrier behind async ones");
    if (w1.ok() && w2.ok()) {
      ExpectOk((*w2)->Wait(), "ReduceScatterAsync Wait");
      ExpectOk((*w1)->Wait(), "AllGatherAsync Wait");
      std::vector<float> want;
      for (int j = 0; j < p; ++j) {
        for (int64_t i = 0; i < n; ++i) want.push_back(Gen<float>(j, i, 5, false));
      }
      ExpectData(ag, want, "AllGatherAsync");
      ExpectData(rs, RefReduced<float>(CommReduceOp::kSum, p, r * n, n, 6, false, -1, -1), "ReduceScatterAsync");
    }
    ExpectData(ar, RefReduced<float>(CommReduceOp::kSum, p, 0, 40, 7, false, -1, -1), "AllReduce behind async");
    // Progress off the caller's thread: the last rank arrives 600 ms late; the others' *Async
    // call returns at once (well before the late rank: under 300 ms, with room for a loaded
    // 2-core machine, where 3 ranks once took 110 ms to return against a limit of 50) and the
    // collective completes while they do something else.
    Tensor x = Fill<float>(r, 1000, 8, false), y = Make<float>(1000 * p);
    if (r == p - 1) absl::SleepFor(absl::Milliseconds(600));
    const absl::Time t0 = absl::Now();
    auto w = comm.AllGatherAsync(x, y);
    const absl::Duration issue = absl::Now() - t0;
    ExpectOk(w.status(), "AllGatherAsync (late rank)");
    if (w.ok()) {
      if (r != p - 1) {
        ++g_checks;
        if (issue > absl::Milliseconds(300))
          Fail(absl::StrCat("AllGatherAsync blocked for ", absl::FormatDuration(issue)));
        absl::SleepFor(absl::Milliseconds(900));  // "compute"; the late rank joins meanwhile
        ++g_checks;
        if (!(*w)->IsCompleted()) Fail("AllGatherAsync did not progress while the caller computed");
      }
      ExpectOk((*w)->Wait(), "AllGatherAsync (late rank) Wait");
      std::vector<float> want;
      for (int j = 0; j < p; ++j) {
        for (int64_t i = 0; i < 1000; ++i) want.push_back(Gen<float>(j, i, 8, false));
      }
      ExpectData(y, want, "AllGatherAsync (late rank)");
    }
  }
  // Split: odd / even ranks, ordered by descending rank; rank 0 (when p > 2) joins no group.
  const int color = (p > 2 && r == 0) ? -1 : r % 2;
  auto sub = comm.Split(color, -r);
  ExpectOk(sub.status(), "Split");
  if (!sub.ok()) return;
  if (color < 0) {
    ++g_checks;
    if (*sub != nullptr) Fail("Split with color -1 gave a communicator");
  } else {
    std::vector<int> members;
    for (int j = p - 1; j >= 0; --j) {
      if (!(p > 2 && j == 0) && j % 2 == color) members.push_back(j);
    }
    Communicator& c = **sub;
    ++g_checks;
    if (c.size() != static_cast<int>(members.size()) || members[static_cast<size_t>(c.rank())] != r) {
      Fail(absl::StrCat("Split: rank ", r, " got rank ", c.rank(), " of ", c.size()));
    } else {
      for (int64_t n : {int64_t{3}, int64_t{100000}}) {
        Tensor x = Make<int64_t>(n), y = Make<int64_t>(n);
        for (int64_t i = 0; i < n; ++i) x.data<int64_t>()[i] = r * 1000 + i;
        ExpectOk(c.AllReduce(x, y, CommReduceOp::kSum), "sub AllReduce");
        std::vector<int64_t> want;
        for (int64_t i = 0; i < n; ++i) {
          int64_t s = 0;
          for (int m : members) s += m * 1000 + i;
          want.push_back(s);
        }
        ExpectData(y, want, absl::StrCat("sub AllReduce n=", n, " rank ", r));
        Tensor g = Make<int64_t>(n * c.size());
        ExpectOk(c.AllGather(x, g), "sub AllGather");
        std::vector<int64_t> gw;
        for (int m : members) {
          for (int64_t i = 0; i < n; ++i) gw.push_back(m * 1000 + i);
        }
        ExpectData(g, gw, absl::StrCat("sub AllGather n=", n, " rank ", r));
      }
      auto subsub = c.Split(0, 0);  // a split of a split
      ExpectOk(subsub.status(), "Split of a split");
      if (subsub.ok()) ExpectOk((*subsub)->Barrier(), "sub-sub Barrier");
    }
  }
  ExpectOk(comm.Barrier(), "final Barrier");  // the world still works after the splits
}

// Many broadcasts back to back (the root may run ahead of its readers on the shared-memory
// channel), with rotating roots and sizes on both sides of the small-message ring, and other
// collectives in between: every rank checks every element.
void BroadcastStream(Communicator& c) {
  const int p = c.size();
  for (int i = 0; i < 600; ++i) {
    const int root = (i / 3) % p;
    const int64_t n = i % 5 == 4 ? 12000 : 1 + (i * 37) % 8000;  // 48 KB: above the 32 KiB ring
    Tensor t = Make<int32_t>(n);
    int32_t* v = t.data<int32_t>();
    for (int64_t k = 0; k < n; ++k) v[k] = c.rank() == root ? static_cast<int32_t>(i * 100003 + k) : -1;
    ExpectOk(c.Broadcast(t, root), "Broadcast stream");
    int bad = 0;
    for (int64_t k = 0; k < n; ++k) bad += v[k] != static_cast<int32_t>(i * 100003 + k);
    if (bad != 0) Fail(absl::StrCat("Broadcast stream ", i, " (root ", root, ", ", n, " elements): ", bad, " wrong"));
    ++g_checks;
    if (i % 7 == 6) {
      Tensor x = Fill<int32_t>(c.rank(), 999, i, false), y = Make<int32_t>(999);
      ExpectOk(c.AllReduce(x, y, CommReduceOp::kSum), "AllReduce in a broadcast stream");
      ExpectData(y, RefReduced<int32_t>(CommReduceOp::kSum, p, 0, 999, i, false, -1, -1), "AllReduce in a stream");
    }
  }
}

// AllToAllBlocks with views as blocks: the column blocks of S(0) -> S(1), strided and
// transposed receive views, the in-place exchange (every send view is its receive view),
// receive views overlapping the sends one row down, receive blocks of another shape, sizes of several shared-memory
// windows; with `uniform` (the ucx shared-memory path copies views to and from its slots) and without (the default
// packs). Values: V(rank, i, c) of each rank's local [rows, p x cols] matrix.
template <typename T>
T V(int rank, int64_t i, int64_t c) {
  return static_cast<T>((rank * 7919 + i * 31 + c) % 65536);  // exact in float32
}

template <typename T>
void BlocksCase(Communicator& comm, const char* tname, int64_t rows, int64_t cols, bool uniform) {
  const int p = comm.size(), r = comm.rank();
  const DType dt = DTypeOf<T>::value;
  const std::string at = absl::StrCat("AllToAllBlocks ", tname, " [", rows, " x ", cols, "] p=", p,
                                      uniform ? " uniform" : "", " rank ", r);
  Tensor local = *Tensor::Empty({rows, p * cols}, dt);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < p * cols; ++c) local.data<T>()[i * p * cols + c] = V<T>(r, i, c);
  }
  // What arrives from rank j, in row-major order of its [rows, cols] block: V(j, i, r cols + c).
  std::vector<T> want;
  for (int j = 0; j < p; ++j) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < cols; ++c) want.push_back(V<T>(j, i, r * cols + c));
    }
  }
  std::vector<Tensor> sends;
  for (int j = 0; j < p; ++j) sends.push_back(*local.Narrow(1, j * cols, cols));
  auto contiguous = [](const Tensor& t) { return *Contiguous(t); };
  // Contiguous receive blocks (the [p rows, cols] output of S(0) -> S(1)).
  {
    Tensor out = *Tensor::Empty({p * rows, cols}, dt);
    std::vector<Tensor> recvs;
    for (int j = 0; j < p; ++j) recvs.push_back(*out.Narrow(0, j * rows, rows));
    ExpectOk(comm.AllToAllBlocks(sends, recvs, uniform), at);
    ExpectData(out, want, at);
  }
  // Receive views with a last-dim stride != 1: a transposed buffer.
  {
    Tensor out = *(*Tensor::Empty({cols, p * rows}, dt)).Transpose(0, 1);
    std::vector<Tensor> recvs;
    for (int j = 0; j < p; ++j) recvs.push_back(*out.Narrow(0, j * rows, rows));
    ExpectOk(comm.AllToAllBlocks(sends, recvs, uniform), at + " (transposed receive)");
    ExpectData(contiguous(out), want, at + " (transposed receive)");
  }
  // Flat 1-d receive blocks (another shape, same count).
  {
    Tensor out = *Tensor::Empty({p * rows * cols}, dt);
    std::vector<Tensor> recvs;
    for (int j = 0; j < p; ++j) recvs.push_back(*out.Narrow(0, j * rows * cols, rows * cols));
    ExpectOk(comm.AllToAllBlocks(sends, recvs, uniform), at + " (flat receive)");
    ExpectData(out, want, at + " (flat receive)");
  }
  // In place: column block j of `buf` goes to rank j and is replaced by rank j's block r.
  {
    Tensor buf = *Clone(local);
    std::vector<Tensor> views;
    for (int j = 0; j < p; ++j) views.push_back(*buf.Narrow(1, j * cols, cols));
    ExpectOk(comm.AllToAllBlocks(views, views, uniform), at + " (in place)");
    std::vector<T> in_place;
    for (int64_t i = 0; i < rows; ++i) {
      for (int j = 0; j < p; ++j) {
        for (int64_t c = 0; c < cols; ++c) in_place.push_back(V<T>(j, i, r * cols + c));
      }
    }
    ExpectData(buf, in_place, at + " (in place)");
  }
  // Receive views one row below the send views in the same buffer ([rows + 1, p x cols]):
  // the sends must be read before the receives overwrite them.
  {
    Tensor buf = *Tensor::Empty({rows + 1, p * cols}, dt);
    for (int64_t i = 0; i <= rows; ++i) {
      for (int64_t c = 0; c < p * cols; ++c) buf.data<T>()[i * p * cols + c] = V<T>(r, i, c);
    }
    std::vector<Tensor> sends2, recvs2;
    for (int j = 0; j < p; ++j) {
      const Tensor block = *buf.Narrow(1, j * cols, cols);
      sends2.push_back(*block.Narrow(0, 0, rows));
      recvs2.push_back(*block.Narrow(0, 1, rows));
    }
    ExpectOk(comm.AllToAllBlocks(sends2, recvs2, uniform), at + " (shifted overlap)");
    std::vector<T> shifted;
    for (int64_t c = 0; c < p * cols; ++c) shifted.push_back(V<T>(r, 0, c));
    for (int64_t i = 0; i < rows; ++i) {
      for (int j = 0; j < p; ++j) {
        for (int64_t c = 0; c < cols; ++c) shifted.push_back(V<T>(j, i, r * cols + c));
      }
    }
    ExpectData(buf, shifted, at + " (shifted overlap)");
  }
  ExpectData(
      local,
      [&] {
        std::vector<T> v;
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t c = 0; c < p * cols; ++c) v.push_back(V<T>(r, i, c));
        }
        return v;
      }(),
      at + " (input untouched)");
}

// S(0) -> S(1) of a global [rows, cols] float32 matrix G(i, c) = (131 i + c) mod 65536 cut
// with torch.chunk (uneven; trailing ranks may hold nothing): blocks of different sizes.
void UnevenBlocksCase(Communicator& comm, int64_t rows, int64_t cols) {
  const int p = comm.size(), r = comm.rank();
  auto chunk = [p](int64_t n, int j) {  // torch.chunk: [start, size)
    const int64_t c = (n + p - 1) / p, start = std::min(n, c * j);
    return std::pair<int64_t, int64_t>{start, std::min(n, start + c) - start};
  };
  auto g = [](int64_t i, int64_t c) { return static_cast<float>((131 * i + c) % 65536); };
  const auto [r0, nr] = chunk(rows, r);
  const auto [c0, nc] = chunk(cols, r);
  Tensor local = *Tensor::Empty({nr, cols}, DType::kFloat32);
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t c = 0; c < cols; ++c) local.data<float>()[i * cols + c] = g(r0 + i, c);
  }
  Tensor out = *Tensor::Empty({rows, nc}, DType::kFloat32);
  std::vector<Tensor> sends, recvs;
  for (int j = 0; j < p; ++j) {
    sends.push_back(*local.Narrow(1, chunk(cols, j).first, chunk(cols, j).second));
    recvs.push_back(*out.Narrow(0, chunk(rows, j).first, chunk(rows, j).second));
  }
  const std::string at = absl::StrCat("AllToAllBlocks uneven [", rows, " x ", cols, "] p=", p, " rank ", r);
  ExpectOk(comm.AllToAllBlocks(sends, recvs, /*uniform=*/false), at);
  std::vector<float> want;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < nc; ++c) want.push_back(g(i, c0 + c));
  }
  ExpectData(out, want, at);
}

void Blocks(Communicator& comm) {
  // Uneven: [1500 x 301] and [2000 x 401] take two windows of 512 KiB / p on 2-4 ranks.
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 5}, {1, 5}, {3, 0}, {1500, 301}, {2000, 401}}) {
    UnevenBlocksCase(comm, rows, cols);
  }
  // A sender's count that differs from its receiver's: InvalidArgument on every rank, naming
  // both, and the communicator stays usable.
  if (comm.size() > 1) {
    std::vector<Tensor> sends, recvs;
    for (int j = 0; j < comm.size(); ++j) {
      sends.push_back(Make<float>(2));
      recvs.push_back(Make<float>(comm.rank() == 1 && j == 0 ? 3 : 2));
    }
    const absl::Status s = comm.AllToAllBlocks(sends, recvs, /*uniform=*/false);
    ++g_checks;
    if (!absl::IsInvalidArgument(s) ||
        s.message().find("rank 0 sends 2 elements to rank 1, which expects 3") == std::string::npos) {
      Fail(absl::StrCat("AllToAllBlocks mismatched counts on rank ", comm.rank(), ": ", s.ToString()));
    }
    ExpectOk(comm.Barrier(), "Barrier after mismatched AllToAllBlocks counts");
  }
  // [300 x 221] blocks: 66300 elements, over one 512 KiB / p window of float32 or int64.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 3}, {3, 2}, {5, 7}, {300, 221}, {1, 70001}};
  for (bool uniform : {true, false}) {
    for (const auto& [rows, cols] : shapes) {
      BlocksCase<float>(comm, "float32", rows, cols, uniform);
      BlocksCase<int64_t>(comm, "int64", rows, cols, uniform);
    }
  }
  // The uniform promise broken the same way on every rank: InvalidArgument, and no hang.
  const int p = comm.size();
  std::vector<Tensor> sends, recvs;
  for (int j = 0; j < p; ++j) {
    sends.push_back(Make<float>(j == 0 ? 2 : 3));
    recvs.push_back(Make<float>(j == 0 ? 2 : 3));
  }
  const absl::Status s = comm.AllToAllBlocks(sends, recvs, /*uniform=*/true);
  ++g_checks;
  if (p > 1 && !absl::IsInvalidArgument(s)) Fail(absl::StrCat("AllToAllBlocks broken uniform promise: ", s.ToString()));
  if (p > 1 && s.message().find("uniform, but") == std::string::npos) {
    Fail(absl::StrCat("AllToAllBlocks broken uniform promise message: ", s.ToString()));
  }
}

int RunBattery() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(60));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  const absl::Time start = absl::Now();
  Battery<float>(c, "float32");
  Battery<BFloat16>(c, "bfloat16");
  Battery<Float16>(c, "float16");
  Battery<int32_t>(c, "int32");
  Battery<int64_t>(c, "int64");
  Battery<bool>(c, "bool");
  PointToPoint(c);
  BroadcastStream(c);
  SplitAndMisc(c);
  Blocks(c);
  std::printf("%d checks, %d failures, %.2f s\n", g_checks, g_failures, absl::ToDoubleSeconds(absl::Now() - start));
  ExpectOk(c.Barrier(), "last Barrier");  // rank 0 (the store's host) leaves last
  return g_failures == 0 ? 0 : 1;
}

// Survivors print the error they got and exit 0 if it has the expected code.
int RunFailure(bool dead_peer) {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  c.SetTimeout(DefaultTimeout());  // DTENSOR_TIMEOUT_S, after a generous rendezvous
  const int r = c.rank(), p = c.size();
  Tensor x = Fill<float>(r, 1 << 20, 1, false);
  if (!c.AllReduce(x, x, CommReduceOp::kSum).ok()) return 3;  // a healthy one first
  const int victim = dead_peer ? p - 1 : 1;
  if (r == victim) {
    if (dead_peer) {
      usleep(300 * 1000);  // the others are inside the AllReduce by now
      std::fflush(stdout);
      _exit(9);
    }
    sleep(2);  // never joins; exits 0 after the others gave up
    return 0;
  }
  if (dead_peer) std::signal(SIGTERM, SIG_IGN);  // report even though dtrun stops the run
  const absl::Time start = absl::Now();
  absl::Status s = c.AllReduce(x, x, CommReduceOp::kSum);
  std::printf("%s after %.2f s: %s\n", dead_peer ? "dead-peer" : "timeout", absl::ToDoubleSeconds(absl::Now() - start),
              s.ToString().c_str());
  std::fflush(stdout);
  const absl::StatusCode want = dead_peer ? absl::StatusCode::kUnavailable : absl::StatusCode::kDeadlineExceeded;
  if (s.code() != want) return 4;
  // The failure is sticky.
  if (c.Barrier().code() != want) return 5;
  return 0;
}

// Makes the world communicator and does one Barrier (with DTENSOR_UCX_INFO=1, rank 0 prints
// the paths the ranks agreed on).
int RunSetup() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  return comm->Barrier().ok() ? 0 : 1;
}

// The local addresses of the TCP sockets in LISTEN state among this process's file
// descriptors: /proc/self/fd's "socket:[inode]" links matched against /proc/net/tcp{,6}, whose
// addresses are the kernel's in_addr / in6_addr words printed as hex.
std::vector<std::string> ListeningSockets() {
  std::set<std::string> inodes;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> found;
  for (const bool v6 : {false, true}) {
    std::ifstream table(v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(table, line);  // header
    while (std::getline(table, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      const size_t colon = local.find(':');
      if (state != "0A" || inodes.count(inode) == 0 || colon == std::string::npos) continue;  // 0A: LISTEN
      const std::string hex = local.substr(0, colon);
      const int port = static_cast<int>(std::strtol(local.substr(colon + 1).c_str(), nullptr, 16));
      char text[INET6_ADDRSTRLEN] = {};
      if (!v6 && hex.size() == 8) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::strtoul(hex.c_str(), nullptr, 16));
        inet_ntop(AF_INET, &a, text, sizeof(text));
        found.push_back(absl::StrCat(text, ":", port));
      } else if (v6 && hex.size() == 32) {
        in6_addr a{};
        for (int w = 0; w < 4; ++w) {
          const uint32_t word = static_cast<uint32_t>(std::strtoul(hex.substr(8 * w, 8).c_str(), nullptr, 16));
          std::memcpy(reinterpret_cast<char*>(&a) + 4 * w, &word, 4);
        }
        inet_ntop(AF_INET6, &a, text, sizeof(text));
        found.push_back(absl::StrCat("[", text, "]:", port));
      } else {
        found.push_back(absl::StrCat("unreadable:", local));
      }
    }
  }
  return found;
}

int RunListening() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Tensor t = Make<float>(1024);
  if (!comm->AllReduce(t, t, CommReduceOp::kSum).ok()) return 1;
  for (const std::string& addr : ListeningSockets()) std::printf("listening %s\n", addr.c_str());
  std::printf("listening done\n");
  std::fflush(stdout);
  return comm->Barrier().ok() ? 0 : 1;
}

// The inode of the shared block holding t (0: not shared).
int64_t BlockInode(const Tensor& t) {
  const std::optional<SharedCpuRange> r = FindSharedCpuRange(t.raw_data(), t.nbytes());
  struct stat st {};
  if (!r.has_value() || fstat(r->fd, &st) != 0) return 0;
  return static_cast<int64_t>(st.st_ino);
}

// Inodes of the dtensor blocks this process has mapped (its own and its peers').
std::set<int64_t> MappedBlockInodes() {
  std::set<int64_t> inodes;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("dtensor-block") == std::string::npos) continue;
    std::istringstream fields(line);
    std::string range, perms, offset, dev;
    int64_t inode = 0;
    fields >> range >> perms >> offset >> dev >> inode;
    inodes.insert(inode);
  }
  return inodes;
}

// Every rank's inodes of its blocks of `ts`, in rank order (AllGather).
std::vector<int64_t> AllInodes(Communicator& c, const std::vector<const Tensor*>& ts) {
  const int64_t k = static_cast<int64_t>(ts.size());
  Tensor mine = Make<int64_t>(k), all = Make<int64_t>(k * c.size());
  for (int64_t i = 0; i < k; ++i) mine.data<int64_t>()[i] = BlockInode(*ts[static_cast<size_t>(i)]);
  ExpectOk(c.AllGather(mine, all), "AllGather of the block inodes");
  return std::vector<int64_t>(all.data<int64_t>(), all.data<int64_t>() + k * c.size());
}

// One round of RunZeroCopy: checks the results and the mappings, returns every rank's block
// inodes of the round's buffers (4 per rank).
// With `mixed`, odd ranks' buffers are private memory (FromBlob): the even ranks' peers then
// move them through the kernel, and AllReduce past 2 MiB blocks agrees on the slots.
std::vector<int64_t> ZeroCopyRound(Communicator& c, bool on, int round, bool mixed = false) {
  const int p = c.size(), r = c.rank();
  const std::string at = absl::StrCat("round ", round, mixed ? " (odd ranks private)" : "", " rank ", r);
  // 12 MiB of float32: blocks of 3-6 MiB on 2-4 ranks, past 2 MiB, where AllReduce and
  // ReduceScatter first agree on single copy (every rank's buffers shared) or the slots.
  const int64_t n = int64_t{3} << 20;
  const int seed = 11 + 3 * round;
  const bool private_here = mixed && r % 2 == 1;
  std::vector<std::vector<float>> storage;
  auto make = [&](int64_t count) {
    if (!private_here) return Make<float>(count);
    storage.emplace_back(static_cast<size_t>(count));
    return *Tensor::FromBlob(storage.back().data(), {count}, DType::kFloat32, Device::Cpu());
  };
  auto fill = [&](int64_t count, int s) {
    Tensor t = make(count);
    for (int64_t i = 0; i < count; ++i) t.data<float>()[i] = Gen<float>(r, i, s, false);
    return t;
  };
  Tensor in = fill(n, seed), out = make(n);
  Tensor gin = fill(n / p, seed + 1), gout = make(n / p * p);
  Tensor b = fill(n, seed + 2);
  ExpectOk(c.AllReduce(in, out, CommReduceOp::kSum), "AllReduce " + at);
  ExpectData(out, RefReduced<float>(CommReduceOp::kSum, p, 0, n, seed, false, -1, -1), "AllReduce " + at);
  Tensor rs_out = make(n / p);
  ExpectOk(c.ReduceScatter(in, rs_out, CommReduceOp::kSum), "ReduceScatter " + at);
  ExpectData(rs_out, RefReduced<float>(CommReduceOp::kSum, p, r * (n / p), n / p, seed, false, -1, -1),
             "ReduceScatter " + at);
  ExpectOk(c.AllGather(gin, gout), "AllGather " + at);
  std::vector<float> want;
  for (int j = 0; j < p; ++j) {
    for (int64_t i = 0; i < n / p; ++i) want.push_back(Gen<float>(j, i, seed + 1, false));
  }
  ExpectData(gout, want, "AllGather " + at);
  ExpectOk(c.Broadcast(b, p - 1), "Broadcast " + at);
  want.clear();
  for (int64_t i = 0; i < n; ++i) want.push_back(Gen<float>(p - 1, i, seed + 2, false));
  ExpectData(b, want, "Broadcast " + at);
  // Every peer's AllReduce input and output, its AllGather input and (from the broadcast's
  // root, which every rank writes into or reads from) its buffer are mapped here.
  const std::vector<int64_t> inodes = AllInodes(c, {&in, &out, &gin, &b});
  const std::set<int64_t> mapped = MappedBlockInodes();
  for (int j = 0; j < p; ++j) {
    for (int k = 0; k < 4; ++k) {
      const int64_t ino = inodes[static_cast<size_t>(j * 4 + k)];
      if (mixed && j % 2 == 1) {
        ++g_checks;
        if (ino != 0) Fail(absl::StrCat(at, ": rank ", j, "'s private buffer ", k, " is in a shared block"));
        continue;
      }
      ++g_checks;
      if (on == (ino == 0)) {
        Fail(absl::StrCat(at, ": rank ", j, "'s buffer ", k, on ? " is not in a shared block" : " is shared"));
      }
      const bool reader_pair = k == 3 && j != p - 1 && r != p - 1;  // broadcast readers: no data between them
      if (on && !mixed && round == 0 && j != r && reader_pair) {
        // Fresh blocks (later rounds reuse cached ones, which other calls mapped).
        ++g_checks;
        if (mapped.count(ino) != 0) Fail(absl::StrCat(at, ": rank ", j, "'s broadcast buffer is mapped here"));
      }
      if (!on || mixed || j == r || reader_pair) continue;
      ++g_checks;
      if (mapped.count(ino) == 0) {
        Fail(absl::StrCat(at, ": rank ", j, "'s buffer ", k, " (inode ", ino, ") is not mapped here"));
      }
    }
  }
  ++g_checks;
  if (!on && !mapped.empty()) Fail(absl::StrCat(at, ": ", mapped.size(), " blocks mapped with zero copy off"));
  return inodes;
}

int RunZeroCopy(bool on) {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  ++g_checks;
  if (SharedCpuBlocksEnabled() != on) Fail(absl::StrCat("shared blocks enabled: ", SharedCpuBlocksEnabled()));
  const std::vector<int64_t> first = ZeroCopyRound(c, on, 0);
  // Every rank gives round 0's blocks back; round 1 gets new ones, and the peers' mappings of
  // the old ones (their pages kept alive by the mapping alone) must go.
  DefaultAllocator(Device::Cpu()).EmptyCache();
  ExpectOk(c.Barrier(), "Barrier after EmptyCache");
  ZeroCopyRound(c, on, 1);
  // Released mappings go at a sweep, one per 16 calls (ShmGroup::kSweepEvery): 32 more steps
  // (256 KiB blocks: single copy on any rank count).
  {
    Tensor gin = Fill<float>(c.rank(), 1 << 16, 5, false), gout = Make<float>((1 << 16) * c.size());
    for (int i = 0; i < 32; ++i) ExpectOk(c.AllGather(gin, gout), "AllGather to sweep");
  }
  const std::set<int64_t> mapped = MappedBlockInodes();
  ZeroCopyRound(c, on, 2, /*mixed=*/true);
  for (size_t i = 0; i < first.size(); ++i) {
    ++g_checks;
    if (first[i] != 0 && mapped.count(first[i]) != 0) {
      Fail(absl::StrCat("rank ", c.rank(), ": rank ", i / 4, "'s released round-0 block ", i % 4, " (inode ", first[i],
                        ") is still mapped"));
    }
  }
  // The same when only small collectives follow (no single-copy step): the peers see the
  // owners' release counts change (ShmGroup::TrackReleases) within 32 calls.
  const std::vector<int64_t> fourth = ZeroCopyRound(c, on, 3);
  DefaultAllocator(Device::Cpu()).EmptyCache();
  {
    Tensor x = Fill<float>(c.rank(), 1000, 6, false), y = Make<float>(1000);
    for (int i = 0; i < 32; ++i) ExpectOk(c.AllReduce(x, y, CommReduceOp::kSum), "small AllReduce to sweep");
  }
  const std::set<int64_t> still = MappedBlockInodes();
  for (size_t i = 0; i < fourth.size(); ++i) {
    ++g_checks;
    if (fourth[i] != 0 && still.count(fourth[i]) != 0) {
      Fail(absl::StrCat("rank ", c.rank(), ": rank ", i / 4, "'s released round-3 block ", i % 4, " (inode ", fourth[i],
                        ") is still mapped after 32 small calls"));
    }
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  ExpectOk(c.Barrier(), "last Barrier");
  return g_failures == 0 ? 0 : 1;
}

int RunSizeMismatch() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  c.SetTimeout(absl::Seconds(20));
  const int64_t n = c.rank() == 1 ? int64_t{1} << 17 : int64_t{1} << 18;  // 512 KiB / 1 MiB blocks
  Tensor in = Fill<float>(c.rank(), n, 3, false), out = Make<float>(n * c.size());
  const absl::Status s = c.AllGather(in, out);
  std::printf("AllGather: %s\n", s.ToString().c_str());
  if (c.rank() == 0) {
    return s.code() == absl::StatusCode::kInvalidArgument && s.message().find("holds 524288 bytes") != std::string::npos
               ? 0
               : 1;
  }
  return s.ok() ? 1 : 0;
}

int RunDebugMismatch() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  const int r = c.rank(), p = c.size();
  Tensor a = Fill<float>(r, 12, 1, false);
  Tensor g = Make<float>(3 * p);
  const absl::Status s = r == 1 ? c.AllGather(*a.Narrow(0, 0, 3), g) : c.AllReduce(a, a, CommReduceOp::kSum);
  std::printf("mismatch: %s\n", s.ToString().c_str());
  std::fflush(stdout);
  if (s.code() != absl::StatusCode::kInvalidArgument || s.message().find("[Debug] rank ") != 0) return 4;
  // The mismatch was caught before any data moved: the communicator is still usable.
  Tensor x = Fill<float>(r, 1000, 2, false), y = Make<float>(1000);
  if (!c.AllReduce(x, y, CommReduceOp::kSum).ok()) return 5;
  ExpectData(y, RefReduced<float>(CommReduceOp::kSum, p, 0, 1000, 2, false, -1, -1), "AllReduce after a mismatch");
  if (g_failures != 0) return 6;
  return c.Barrier().ok() ? 0 : 7;
}

// Each round one rank (in turn) comes 3 ms late to a collective, so the others wait long
// enough to sleep on its futex word (past the spin and yield phases): AllReduce, a Broadcast
// from the late rank and from another, an AllGather and a Barrier, results checked. The
// waits must wake for the late rank (a missed wake-up costs at most a peer-check period,
// 1 ms, per sleep) and count down their sleeper registration (WaitFor), round after round.
int RunLateRanks() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(30));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  // A timeout past the steady clock's range (400 years) waits like an infinite one: its
  // deadline once wrapped negative and every wait for a late rank failed at once.
  c.SetTimeout(absl::Hours(24 * 365 * 400));
  const int r = c.rank(), p = c.size();
  const int64_t n = 1000;
  const absl::Time start = absl::Now();
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds * 5; ++round) {
    const int late = round / 5 % p;
    if (r == late) absl::SleepFor(absl::Milliseconds(3));
    const std::string at = absl::StrCat("round ", round, ", rank ", late, " late");
    switch (round % 5) {
      case 0: {
        Tensor in = Fill<float>(r, n, round, false), out = Make<float>(n);
        ExpectOk(c.AllReduce(in, out, CommReduceOp::kSum), "AllReduce " + at);
        ExpectData(out, RefReduced<float>(CommReduceOp::kSum, p, 0, n, round, false, -1, -1), "AllReduce " + at);
        break;
      }
      case 1:
      case 2: {
        const int root = round % 5 == 1 ? late : (late + 1) % p;
        Tensor t = r == root ? Fill<float>(root, n, round, false) : Make<float>(n);
        ExpectOk(c.Broadcast(t, root), "Broadcast " + at);
        std::vector<float> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = Gen<float>(root, i, round, false);
        ExpectData(t, want, absl::StrCat("Broadcast from ", root, ", ", at));
        break;
      }
      case 3: {
        Tensor in = Fill<float>(r, n, round, false), out = Make<float>(n * p);
        ExpectOk(c.AllGather(in, out), "AllGather " + at);
        std::vector<float> want;
        for (int q = 0; q < p; ++q) {
          for (int64_t i = 0; i < n; ++i) want.push_back(Gen<float>(q, i, round, false));
        }
        ExpectData(out, want, "AllGather " + at);
        break;
      }
      default:
        ExpectOk(c.Barrier(), "Barrier " + at);
    }
  }
  // 40 calls with a 3 ms late rank each: about 0.12 s. A wake-up that never comes would hold
  // a waiter for its 1 ms sleeps until the deadline (30 s) instead.
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (seconds > 10) Fail(absl::StrCat("40 late-rank rounds took ", seconds, " s"));
  std::printf("%d checks, %d failures, %.3f s\n", g_checks, g_failures, seconds);
  return g_failures == 0 ? 0 : 1;
}

// Not a test: AllReduce / ReduceScatter / AllGather timings (float32), nccl-tests style.
int RunBench() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(60));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  const int p = c.size();
  for (int64_t bytes = 4096; bytes <= (int64_t{64} << 20); bytes *= 4) {
    const int64_t n = bytes / 4 / p * p;
    Tensor x = Fill<float>(c.rank(), n, 1, false), y = Make<float>(n), s = Make<float>(n / p);
    for (const std::string name : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"}) {
      auto once = [&] {
        if (name == "all_reduce") return c.AllReduce(x, y, CommReduceOp::kSum);
        if (name == "reduce_scatter") return c.ReduceScatter(x, s, CommReduceOp::kSum);
        if (name == "all_to_all") return c.AllToAll(x, y);
        if (name == "broadcast") return c.Broadcast(y, 0);
        return c.AllGather(s, y);
      };
      const int iters = bytes <= (1 << 20) ? 200 : 10;
      for (int i = 0; i < 3; ++i) (void)once();
      (void)c.Barrier();
      const absl::Time t0 = absl::Now();
      for (int i = 0; i < iters; ++i) (void)once();
      const double us = absl::ToDoubleMicroseconds(absl::Now() - t0) / iters;
      const double factor = name == "all_reduce"  ? 2.0 * (p - 1) / p
                            : name == "broadcast" ? 1.0
                                                  : static_cast<double>(p - 1) / p;
      if (c.rank() == 0) {
        std::printf("%10lld B  %-15s %10.1f us  busbw %8.3f GB/s\n", static_cast<long long>(n * 4), name.c_str(), us,
                    static_cast<double>(n * 4) * factor / us / 1e3);
      }
    }
  }
  return c.Barrier().ok() ? 0 : 1;
}

// Not a test: S(0) -> S(1) of a float32 [n, n] matrix as AllToAllBlocks of column blocks,
// beside the default implementation (pack, AllToAll, the receive views already back to back)
// and the plain AllToAll of the same bytes; calls interleaved, medians of 15 trials.
int RunBenchBlocks() {
  std::unique_ptr<Communicator> comm = MakeWorld(absl::Seconds(60));
  if (comm == nullptr) return 2;
  Communicator& c = *comm;
  const int p = c.size();
  if (c.rank() == 0)
    std::printf("%10s %12s %12s %12s  (us per call, %d ranks)\n", "global", "blocks", "pack+a2a", "a2a", p);
  for (const int64_t n : {int64_t{512}, int64_t{1024}, int64_t{2048}}) {
    Tensor local = Fill<float>(c.rank(), n / p * n, 1, false);
    local = *local.View({n / p, n});
    Tensor out = *Tensor::Empty({n, n / p}, DType::kFloat32), flat_out = *out.View({n * n / p});
    Tensor flat_in = *local.View({n * n / p});
    std::vector<Tensor> sends, recvs;
    for (int j = 0; j < p; ++j) {
      sends.push_back(*local.Narrow(1, j * (n / p), n / p));
      recvs.push_back(*out.Narrow(0, j * (n / p), n / p));
    }
    std::vector<std::function<absl::Status()>> fns = {
        [&] { return c.AllToAllBlocks(sends, recvs, true); },
        [&] { return c.Communicator::AllToAllBlocks(sends, recvs, true); },
        [&] { return c.AllToAll(flat_in, flat_out); }};
    std::vector<std::vector<double>> us(fns.size());
    const int iters = n <= 1024 ? 100 : 20;
    for (int t = 0; t < 15; ++t) {
      for (size_t f = 0; f < fns.size(); ++f) {
        (void)fns[f]();
        (void)c.Barrier();
        const absl::Time t0 = absl::Now();
        for (int i = 0; i < iters; ++i) (void)fns[f]();
        us[f].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0) / iters);
      }
    }
    for (auto& v : us) std::sort(v.begin(), v.end());
    if (c.rank() == 0) {
      std::printf("%4lld MiB   %12.1f %12.1f %12.1f\n", static_cast<long long>(n * n * 4 >> 20), us[0][7], us[1][7],
                  us[2][7]);
    }
  }
  return c.Barrier().ok() ? 0 : 1;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "battery") return dtensor::RunBattery();
  if ((mode == "battery-mixed" || mode == "setup-mixed") && argc > 2) {
    const std::string setting = argv[2];
    const char* rank = std::getenv("RANK");
    if (rank != nullptr && std::atoi(rank) % 2 == 1) {
      const size_t eq = setting.find('=');
      if (setting == "one-cpu") {
        // Onto the lowest CPU of dtrun's (the parent's) affinity: where dtrun binds rank 0.
        cpu_set_t set;
        CPU_ZERO(&set);
        if (sched_getaffinity(getppid(), sizeof(set), &set) != 0) return 2;
        int first = -1;
        for (int c = 0; c < CPU_SETSIZE && first < 0; ++c) {
          if (CPU_ISSET(c, &set)) first = c;
        }
        if (first < 0) return 2;
        CPU_ZERO(&set);
        CPU_SET(first, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) return 2;
      } else if (eq != std::string::npos) {
        setenv(setting.substr(0, eq).c_str(), setting.substr(eq + 1).c_str(), 1);
      } else {
        std::fprintf(stderr, "%s: SETTING is NAME=VALUE or one-cpu, not '%s'\n", mode.c_str(), setting.c_str());
        return 2;
      }
    }
    return mode == "setup-mixed" ? dtensor::RunSetup() : dtensor::RunBattery();
  }
  if (mode == "dead-peer") return dtensor::RunFailure(true);
  if (mode == "timeout") return dtensor::RunFailure(false);
  if (mode == "zero-copy" && argc > 2) return dtensor::RunZeroCopy(std::string(argv[2]) == "on");
  if (mode == "size-mismatch") return dtensor::RunSizeMismatch();
  if (mode == "bench") return dtensor::RunBench();
  if (mode == "bench-blocks") return dtensor::RunBenchBlocks();
  if (mode == "debug-mismatch") return dtensor::RunDebugMismatch();
  if (mode == "setup") return dtensor::RunSetup();
  if (mode == "late-ranks") return dtensor::RunLateRanks();
  if (mode == "listening") return dtensor::RunListening();
  std::fprintf(stderr,
               "usage: ucx_test_child battery|battery-mixed "
               "SETTING|dead-peer|timeout|debug-mismatch|setup|late-ranks|listening|bench|bench-blocks\n");
  return 2;
}
