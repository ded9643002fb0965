#include "dtensor/nn/parallel/activation_checkpoint.h"

#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dtensor/autograd/checkpoint.h"

namespace dtensor::nn {
namespace {

// The dropout call counters of a block's Dropout modules: saved when its forward starts, put
// back for the recomputation.
std::function<std::function<void()>()> DropoutState(Module& block) {
  std::vector<Dropout*> dropouts;
  for (auto& [name, m] : block.NamedModules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) dropouts.push_back(d);
  }
  if (dropouts.empty()) return nullptr;
  return [dropouts]() -> std::function<void()> {
    std::vector<uint64_t> calls;
    for (const Dropout* d : dropouts) calls.push_back(d->calls());
    return [dropouts, calls] {
      for (size_t i = 0; i < dropouts.size(); ++i) dropouts[i]->set_calls(calls[i]);
    };
  };
}

}  // namespace

std::string AcOptions::ToString() const {
  switch (mode) {
    case Mode::kNone:
      return "none";
    case Mode::kFull:
      return "full";
    case Mode::kSelectiveLayer:
      return absl::StrCat("selective:", every);
    case Mode::kSelectiveOp:
      return "selective:op";
  }
  return "?";
}

absl::StatusOr<AcOptions> ParseAcMode(std::string_view view) {
  const std::string text(view);  // (Abseil's string_view is not std's on every build)
  AcOptions o;
  if (text == "none") return o;
  if (text == "full") {
    o.mode = AcOptions::Mode::kFull;
    return o;
  }
  if (text == "selective") {
    o.mode = AcOptions::Mode::kSelectiveLayer;
    return o;
  }
  const std::string prefix = "selective:";
  if (text.compare(0, prefix.size(), prefix) == 0) {
    const std::string rest = text.substr(prefix.size());
    if (rest == "op") {
      o.mode = AcOptions::Mode::kSelectiveOp;
      return o;
    }
    int64_t every = 0;
    if (absl::SimpleAtoi(rest, &every) && every >= 1 && rest[0] != '+') {
      o.mode = AcOptions::Mode::kSelectiveLayer;
      o.every = every;
      return o;
    }
    return absl::InvalidArgumentError(absl::StrCat("[ParseAcMode] '", text,
                                                   "': after 'selective:' comes 'op' or a block frequency N >= 1, "
                                                   "not '",
                                                   rest, "'"));
  }
  return absl::InvalidArgumentError(absl::StrCat("[ParseAcMode] unknown activation checkpointing mode '", text,
                                                 "'; expected none, full, selective, selective:op or selective:N"));
}

std::vector<int64_t> CheckpointedBlocks(int64_t n_layer, const AcOptions& options) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n_layer; ++i) {
    const bool on =
        options.mode == AcOptions::Mode::kFull || options.mode == AcOptions::Mode::kSelectiveOp ||
        (options.mode == AcOptions::Mode::kSelectiveLayer && options.every >= 1 && (i + 1) % options.every == 0);
    if (on) out.push_back(i);
  }
  return out;
}

absl::Status ApplyActivationCheckpointing(GPT& model, const AcOptions& options) {
  if (options.mode == AcOptions::Mode::kSelectiveLayer && options.every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("[ApplyActivationCheckpointing] selective every must be >= 1, got ", options.every));
  }
  if (options.mode == AcOptions::Mode::kSelectiveOp && options.save_ops.empty()) {
    return absl::InvalidArgumentError("[ApplyActivationCheckpointing] selective:op with no ops to save");
  }
  // Every block, not only those this mode picks: selective:2 then selective:3 picks blocks 1
  // and 3 then 2, and would have checkpointed 1, 2 and 3.
  for (int64_t i = 0; i < model.config().n_layer; ++i) {
    if (model.block(i)->has_forward_wrapper()) {
      return absl::FailedPreconditionError(absl::StrCat("[ApplyActivationCheckpointing] block transformer.h.", i,
                                                        " is wrapped already (checkpointing applied twice?)"));
    }
  }
  for (int64_t i : CheckpointedBlocks(model.config().n_layer, options)) {
    CheckpointOptions ck;
    ck.capture_state = DropoutState(*model.block(i));
    if (options.mode == AcOptions::Mode::kSelectiveOp) ck.save_ops = options.save_ops;
    model.block(i)->SetForwardWrapper(
        [ck](const Variable& x, const Module::Body& body) { return ActivationCheckpoint(body, x, ck); });
  }
  return absl::OkStatus();
}

}  // namespace dtensor::nn
