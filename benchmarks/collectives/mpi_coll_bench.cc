// mpi_coll_bench: the same collectives, sizes, timing, checks and table as coll_bench, through
// MPI (MPI_Allreduce, MPI_Allgather, MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Bcast on
// MPI_COMM_WORLD), so that compare.sh can put Open MPI beside dtensor.
//   mpirun -np N [--mca pml ucx ...] mpi_coll_bench [flags]
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "benchmarks/collectives/coll_bench_common.h"

namespace dtensor::bench {
namespace {

class MpiBackend : public Backend {
 public:
  MpiBackend() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiBackend() override { Allocate(0, 0); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void Allocate(int64_t in_count, int64_t out_count) override {
    std::free(in_);
    std::free(out_);
    in_ = Alloc(in_count);
    out_ = Alloc(out_count);
    in_count_ = in_count;
    out_count_ = out_count;
  }
  float* in() override { return in_; }
  float* out() override { return out_; }

  void Run(Coll c) override {
    int rc = MPI_SUCCESS;
    switch (c) {
      case Coll::kAllReduce:
        rc = MPI_Allreduce(in_, out_, Int(in_count_), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Coll::kAllGather:
        rc = MPI_Allgather(in_, Int(in_count_), MPI_FLOAT, out_, Int(in_count_), MPI_FLOAT, MPI_COMM_WORLD);
        break;
      case Coll::kReduceScatter:
        rc = MPI_Reduce_scatter_block(in_, out_, Int(out_count_), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Coll::kAllToAll:
        rc = MPI_Alltoall(in_, Int(in_count_ / size_), MPI_FLOAT, out_, Int(in_count_ / size_), MPI_FLOAT,
                          MPI_COMM_WORLD);
        break;
      case Coll::kBroadcast:
        rc = MPI_Bcast(in_, Int(in_count_), MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    }
    Check(rc, CollName(c));
  }
  void Barrier() override { Check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  int64_t AllMax(int64_t v) override { return Reduce(v, MPI_MAX); }
  int64_t AllSum(int64_t v) override { return Reduce(v, MPI_SUM); }

 private:
  float* Alloc(int64_t n) {
    if (n == 0) return nullptr;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);  // as dtensor's tensors: 64-byte aligned
    if (p == nullptr) Fatal(rank_, "out of memory");
    return static_cast<float*>(p);
  }
  int Int(int64_t n) const {
    if (n > INT32_MAX) Fatal(rank_, "count over INT_MAX");
    return static_cast<int>(n);
  }
  int64_t Reduce(int64_t v, MPI_Op op) {
    int64_t result = 0;
    Check(MPI_Allreduce(&v, &result, 1, MPI_INT64_T, op, MPI_COMM_WORLD), "MPI_Allreduce of int64");
    return result;
  }
  void Check(int rc, const char* what) const {
    if (rc == MPI_SUCCESS) return;
    char message[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(rc, message, &length);
    Fatal(rank_, std::string(what) + ": " + std::string(message, length));
  }

  int rank_ = 0;
  int size_ = 1;
  float* in_ = nullptr;
  float* out_ = nullptr;
  int64_t in_count_ = 0;
  int64_t out_count_ = 0;
};

int Main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  Options options;
  for (int i = 1; i < argc; ++i) {
    if (!ParseCommonFlag(argc, argv, &i, &options)) {
      std::fprintf(stderr, "usage: mpirun -np N mpi_coll_bench [flags]\n%s", kCommonUsage);
      MPI_Finalize();
      return 2;
    }
  }
  int64_t wrong = 0;
  {
    MpiBackend backend;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string library(version, length);  // "Open MPI v4.1.4, package: ..."
    library = library.substr(0, library.find_first_of(",\n"));
    wrong = RunAll(backend, options, "mpi_coll_bench: " + library);
  }
  MPI_Finalize();
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace dtensor::bench

int main(int argc, char** argv) { return dtensor::bench::Main(argc, argv); }
