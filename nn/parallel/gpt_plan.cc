#include "dtensor/nn/parallel/gpt_plan.h"

#include "absl/strings/match.h"

namespace dtensor::nn {

ParallelizePlan GptTensorParallelPlan(bool sequence_parallel) {
  if (!sequence_parallel) {
    return {{"transformer.wte", RowwiseParallel{.input_layout = Replicate()}},
            {"transformer.h.*.attn.c_attn", ColwiseParallel{.fused = 3}},
            {"transformer.h.*.attn.c_proj", RowwiseParallel{}},
            {"transformer.h.*.mlp.c_fc", ColwiseParallel{}},
            {"transformer.h.*.mlp.c_proj", RowwiseParallel{}},
            {"lm_head", ColwiseParallel{}}};
  }
  return {{"transformer.wte", RowwiseParallel{.input_layout = Replicate(), .output_layout = Shard(1)}},
          {"transformer.h.*.ln_1", SequenceParallel{}},
          {"transformer.h.*.attn", PrepareModuleInput{.input_layout = Shard(1), .desired_input_layout = Replicate()}},
          {"transformer.h.*.attn.c_attn", ColwiseParallel{.fused = 3}},
          {"transformer.h.*.attn.c_proj", RowwiseParallel{.output_layout = Shard(1)}},
          {"transformer.h.*.ln_2", SequenceParallel{}},
          {"transformer.h.*.mlp", PrepareModuleInput{.input_layout = Shard(1), .desired_input_layout = Replicate()}},
          {"transformer.h.*.mlp.c_fc", ColwiseParallel{}},
          {"transformer.h.*.mlp.c_proj", RowwiseParallel{.output_layout = Shard(1)}},
          {"transformer.ln_f", SequenceParallel{}},
          {"lm_head", ColwiseParallel{.input_layout = Shard(1)}}};
}

int64_t GptFsdpShardDim(const std::string& name, const Value& param) {
  const bool stacked = (absl::EndsWith(name, "attn.c_attn.weight") && param.dim() == 3) ||
                       (absl::EndsWith(name, "attn.c_attn.bias") && param.dim() == 2);
  return stacked ? 1 : 0;
}

}  // namespace dtensor::nn
