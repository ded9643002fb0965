// The tensor-parallel plan of nn::GPT, as TorchTitan's parallelize_llama lays out Llama
// (Megatron's scheme): per block two all_reduces in forward and two in backward without
// sequence parallel, two all_gather / reduce_scatter pairs each way with it.
//
//   DT_RETURN_IF_ERROR(ParallelizeModule(model, mesh, GptTensorParallelPlan(), "tp"));
//
// With sequence parallel (the default):
//   transformer.wte            RowwiseParallel(output=S(1))   vocab-sharded table; P -> S(1)
//   transformer.h.*.ln_1       SequenceParallel               on S(1)
//   transformer.h.*.attn       PrepareModuleInput(input=S(1), desired=R)   all_gather
//   transformer.h.*.attn.c_attn  ColwiseParallel(fused=3)     each rank: q, k, v of its heads
//   transformer.h.*.attn.c_proj  RowwiseParallel(output=S(1)) P -> S(1): reduce_scatter
//   transformer.h.*.ln_2, .mlp, .mlp.c_fc, .mlp.c_proj        likewise
//   transformer.ln_f           SequenceParallel
//   lm_head                    ColwiseParallel(input=S(1))    tied to wte: the same S(0);
//                                                             logits S(-1): loss parallel
// Without: the embedding's output and the row-parallel outputs are R (all_reduce), the norms
// and wpe stay replicated, lm_head takes R. wpe is replicated in both. The number of heads
// must divide by the tp degree (heads are what c_attn splits), the vocabulary need not.
#ifndef DTENSOR_NN_PARALLEL_GPT_PLAN_H_
#define DTENSOR_NN_PARALLEL_GPT_PLAN_H_

#include <cstdint>
#include <string>

#include "dtensor/autograd/value.h"
#include "dtensor/nn/parallel/parallelize.h"

namespace dtensor::nn {

ParallelizePlan GptTensorParallelPlan(bool sequence_parallel = true);

// For FSDP after this plan (FsdpOptions::shard_dim_fn): c_attn's stacked weight [3, C/tp, C]
// and bias [3, C/tp] shard dim 1 (dim 0 holds q, k, v: 3 rows would split 2:1 over 2 ranks);
// everything else dim 0.
int64_t GptFsdpShardDim(const std::string& name, const Value& param);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_PARALLEL_GPT_PLAN_H_
