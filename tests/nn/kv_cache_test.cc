// GPT::ForwardCached against GPT::Forward (the full recompute): the logits of every position
// agree to 2e-5 + 2e-5 |x| (float32; the attention over the cache sums in another order than
// the training kernel) whether the sequence comes as a prompt of 1, several or all tokens
// followed by single tokens, or in uneven chunks, for batches of 1 and 2; the first chunk
// (nothing cached yet) runs the training kernel, so its logits are bit-identical. Under
// tensor parallelism (TP 2 and 4 thread ranks, with and without sequence parallel) each rank
// caches only its heads and the logits match one rank's. Errors: past block_size or the
// cache's length (OutOfRange, cache unchanged), a cache of another layer count or batch
// size, a bad ids shape (InvalidArgument). No autograd graph is recorded.
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr int64_t kVocab = 61, kBlock = 16;

nn::GPTConfig Config() { return {.vocab_size = kVocab, .block_size = kBlock, .n_layer = 2, .n_head = 4, .n_embd = 32}; }

// Weights uniform in [-0.3, 0.3) (LayerNorms at 1 and 0): far from uniform attention, so a
// wrong mask or position would show (GPT-2's init, std 0.02, makes attention nearly uniform).
std::unique_ptr<nn::GPT> Model() {
  auto model = Unwrap(nn::GPT::Create(Config()));
  std::vector<std::pair<std::string, Tensor>> state = Unwrap(model->StateDict());
  uint64_t seed = 10;
  for (auto& [name, t] : state) {
    if (name.find("ln_") == std::string::npos) t = testing::Random(t.shape(), DType::kFloat32, ++seed, -0.3, 0.3);
  }
  EXPECT_TRUE(model->LoadStateDict(state).ok());
  model->Eval();
  return model;
}

// Token ids [batch, t]: row r is a fixed pseudo-random sequence.
std::vector<int64_t> Ids(int64_t batch, int64_t t) {
  std::vector<int64_t> ids;
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t i = 0; i < t; ++i) ids.push_back((i * 17 + r * 29 + i * i * 3 + 5) % kVocab);
  }
  return ids;
}

// Columns [start, start + len) of ids [batch, t] as a Variable.
Variable Slice(const std::vector<int64_t>& ids, int64_t batch, int64_t t, int64_t start, int64_t len) {
  std::vector<int64_t> part;
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t i = start; i < start + len; ++i) part.push_back(ids[static_cast<size_t>(r * t + i)]);
  }
  return Variable::Constant(Unwrap(Tensor::FromVector<int64_t>(part, {batch, len})));
}

Tensor Full(const Value& v) { return v.is_dtensor() ? Unwrap(v.dtensor().FullTensor()) : v.local(); }

// Logits [batch, t, V] of a whole sequence fed to ForwardCached in `chunks` (their lengths).
std::vector<double> CachedLogits(nn::GPT& model, const std::vector<int64_t>& ids, int64_t batch, int64_t t,
                                 const std::vector<int64_t>& chunks, std::vector<double>* first_chunk = nullptr) {
  nn::KvCache cache(model.config());
  std::vector<std::vector<double>> per_chunk;  // [batch, len, V] each
  int64_t start = 0;
  for (int64_t len : chunks) {
    Variable logits = Unwrap(model.ForwardCached(Slice(ids, batch, t, start, len), cache));
    EXPECT_FALSE(logits.requires_grad());
    EXPECT_EQ(logits.grad_fn(), nullptr);
    per_chunk.push_back(testing::Values(Full(logits.value())));
    start += len;
    EXPECT_EQ(cache.length(), start);
  }
  if (first_chunk != nullptr) *first_chunk = per_chunk[0];
  // Reassemble [batch, t, V] from the chunks' [batch, len, V].
  std::vector<double> out(static_cast<size_t>(batch * t * kVocab));
  start = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t len = chunks[c];
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t v = 0; v < kVocab; ++v) {
          out[static_cast<size_t>((r * t + start + i) * kVocab + v)] =
              per_chunk[c][static_cast<size_t>((r * len + i) * kVocab + v)];
        }
      }
    }
    start += len;
  }
  return out;
}

std::vector<double> FullLogits(nn::GPT& model, const std::vector<int64_t>& ids, int64_t batch, int64_t t) {
  NoGradGuard no_grad;
  nn::GPT::Output o = Unwrap(model.Forward(Slice(ids, batch, t, 0, t)));
  return testing::Values(Full(o.logits.value()));
}

constexpr testing::Tolerance kTol{2e-5, 2e-5};

TEST(KvCacheTest, CachedLogitsEqualFullRecomputeForEveryPromptLengthAndChunking) {
  auto model = Model();
  for (int64_t batch : {1, 2}) {
    const int64_t t = 12;
    const std::vector<int64_t> ids = Ids(batch, t);
    const std::vector<double> want = FullLogits(*model, ids, batch, t);
    std::vector<std::vector<int64_t>> chunkings;
    for (int64_t prompt : {1, 2, 5, 12}) {  // a prompt, then one token at a time
      std::vector<int64_t> c = {prompt};
      for (int64_t i = prompt; i < t; ++i) c.push_back(1);
      chunkings.push_back(c);
    }
    chunkings.push_back({3, 4, 1, 4});  // pieces of several tokens after a prefix
    chunkings.push_back({1, 5, 6});
    for (const std::vector<int64_t>& c : chunkings) {
      std::vector<double> first;
      const std::vector<double> got = CachedLogits(*model, ids, batch, t, c, &first);
      std::string what = absl::StrCat("batch ", batch, ", chunks");
      for (int64_t n : c) absl::StrAppend(&what, " ", n);
      testing::ExpectNear(got, want, kTol, what);
      // The first chunk runs the training kernel: exactly Forward's logits of that prefix.
      const std::vector<double> direct = FullLogits(
          *model,
          [&] {
            std::vector<int64_t> p;
            for (int64_t r = 0; r < batch; ++r) {
              for (int64_t i = 0; i < c[0]; ++i) p.push_back(ids[static_cast<size_t>(r * t + i)]);
            }
            return p;
          }(),
          batch, c[0]);
      EXPECT_EQ(first, direct) << what;
    }
  }
}

TEST(KvCacheTest, ResetStartsANewSequenceWithTheSameBuffers) {
  auto model = Model();
  const std::vector<int64_t> a = Ids(1, 6), b = Ids(2, 6);
  nn::KvCache cache(model->config());
  ASSERT_TRUE(model->ForwardCached(Slice(a, 1, 6, 0, 6), cache).ok());
  const int64_t bytes = cache.nbytes();
  EXPECT_EQ(bytes, 2 /*layers*/ * 2 /*k, v*/ * 4 * kBlock * 8 * 4 /*B H T D float32*/);
  cache.Reset();
  // Row 1 of b on its own, after the reset, equals a fresh cache's logits.
  std::vector<int64_t> row1(b.begin() + 6, b.end());
  Variable got = Unwrap(model->ForwardCached(Slice(row1, 1, 6, 0, 6), cache));
  EXPECT_EQ(cache.nbytes(), bytes);
  EXPECT_EQ(testing::Values(got.value().local()), FullLogits(*model, row1, 1, 6));
}

TEST(KvCacheTest, ContextPastBlockSizeIsAnErrorAndLeavesTheCache) {
  auto model = Model();
  const std::vector<int64_t> ids = Ids(1, kBlock + 1);
  nn::KvCache cache(model->config());
  ASSERT_TRUE(model->ForwardCached(Slice(ids, 1, kBlock + 1, 0, kBlock - 2), cache).ok());
  absl::StatusOr<Variable> over = model->ForwardCached(Slice(ids, 1, kBlock + 1, kBlock - 2, 3), cache);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kOutOfRange) << over.status();
  EXPECT_NE(over.status().message().find("block_size 16"), std::string::npos) << over.status();
  EXPECT_EQ(cache.length(), kBlock - 2);
  // Exactly filling the block still works, and the logits are still right.
  Variable last = Unwrap(model->ForwardCached(Slice(ids, 1, kBlock + 1, kBlock - 2, 2), cache));
  EXPECT_EQ(cache.length(), kBlock);
  const std::vector<double> full = FullLogits(*model, ids, 1, kBlock);
  testing::ExpectNear(testing::Values(last.value().local()), std::vector<double>(full.end() - 2 * kVocab, full.end()),
                      kTol, "last two positions");
  absl::StatusOr<Variable> one_more = model->ForwardCached(Slice(ids, 1, kBlock + 1, kBlock, 1), cache);
  EXPECT_EQ(one_more.status().code(), absl::StatusCode::kOutOfRange) << one_more.status();

  // A shorter cache: its own limit.
  nn::KvCache short_cache(model->config(), /*max_len=*/4);
  EXPECT_EQ(short_cache.max_len(), 4);
  absl::StatusOr<Variable> five = model->ForwardCached(Slice(ids, 1, kBlock + 1, 0, 5), short_cache);
  EXPECT_EQ(five.status().code(), absl::StatusCode::kOutOfRange) << five.status();
  EXPECT_EQ(short_cache.length(), 0);
}

TEST(KvCacheTest, MismatchedCacheOrIdsAreInvalidArguments) {
  auto model = Model();
  const std::vector<int64_t> ids = Ids(2, 4);
  nn::KvCache three_layers(3, kBlock);
  absl::StatusOr<Variable> r = model->ForwardCached(Slice(ids, 1, 4, 0, 2), three_layers);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("3 layers"), std::string::npos) << r.status();
  // Batch 1, then batch 2 into the same cache.
  nn::KvCache cache(model->config());
  ASSERT_TRUE(model->ForwardCached(Slice(ids, 1, 4, 0, 2), cache).ok());
  r = model->ForwardCached(Slice(ids, 2, 4, 2, 1), cache);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(cache.length(), 2);
  // ids must be [B, T_new].
  Variable flat = Variable::Constant(Unwrap(Tensor::FromVector<int64_t>({1, 2, 3}, {3})));
  EXPECT_EQ(model->ForwardCached(flat, cache).status().code(), absl::StatusCode::kInvalidArgument);
}

// Tensor parallel: logits per position, fed as a prompt of 5 then single tokens, on every
// rank (gathered), against one rank's full recompute.
TEST(KvCacheTest, TensorParallelRanksCacheTheirHeadsAndMatchOneRank) {
  auto ref_model = Model();
  const int64_t t = 10;
  const std::vector<int64_t> ids = Ids(1, t);
  const std::vector<double> want = FullLogits(*ref_model, ids, 1, t);
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      auto comms = Unwrap(MakeThreadGroup(tp, absl::Seconds(60)));
      std::vector<std::vector<double>> got(static_cast<size_t>(tp));
      std::vector<int64_t> cache_bytes(static_cast<size_t>(tp));
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r) {
        threads.emplace_back([&, r] {
          DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {tp}, {"tp"}));
          auto model = Model();
          absl::Status s = nn::ParallelizeModule(*model, mesh, nn::GptTensorParallelPlan(sp), "tp");
          ASSERT_TRUE(s.ok()) << s;
          std::vector<int64_t> chunks = {5};
          for (int64_t i = 5; i < t; ++i) chunks.push_back(1);
          got[static_cast<size_t>(r)] = CachedLogits(*model, ids, 1, t, chunks);
          nn::KvCache cache(model->config());
          ASSERT_TRUE(model->ForwardCached(Slice(ids, 1, t, 0, 3), cache).ok());
          cache_bytes[static_cast<size_t>(r)] = cache.nbytes();
        });
      }
      for (auto& th : threads) th.join();
      const std::string what = absl::StrCat("TP ", tp, sp ? " with" : " without", " sequence parallel");
      for (int r = 0; r < tp; ++r) {
        testing::ExpectNear(got[static_cast<size_t>(r)], want, kTol, absl::StrCat(what, ", rank ", r));
        // Each rank holds H / tp heads: 1/tp of one rank's cache.
        EXPECT_EQ(cache_bytes[static_cast<size_t>(r)], 2 * 2 * 4 * kBlock * 8 * 4 / tp) << what;
      }
    }
  }
}

}  // namespace
}  // namespace dtensor
