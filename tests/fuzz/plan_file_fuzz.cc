// Fuzz target: tensor-parallel plan files (nn/parallel/plan_file.h, ParsePlanFile) on arbitrary
// text. A parse returns a plan or InvalidArgument; a plan prints (PlanFileToJson) to JSON that
// parses back to a plan printing the same.
#include <cstdint>
#include <string>

#include "dtensor/nn/parallel/plan_file.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtensor;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<nn::PlanFile> plan = nn::ParsePlanFile(text, "fuzz.json");
  if (!plan.ok()) {
    FUZZ_CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  const std::string json = nn::PlanFileToJson(*plan);
  absl::StatusOr<nn::PlanFile> again = nn::ParsePlanFile(json, "printed");
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->dims == plan->dims);
  FUZZ_CHECK(nn::PlanFileToJson(*again) == json);
  for (int64_t world : {1, 2, 4, 6}) {
    absl::StatusOr<nn::ParallelDims> dims = plan->dims.Resolve(world);
    if (dims.ok()) {
      FUZZ_CHECK(dims->dp_replicate * dims->dp_shard * dims->tp == world);
    } else {
      FUZZ_CHECK(dims.status().code() == absl::StatusCode::kInvalidArgument);
    }
  }
  return 0;
}
