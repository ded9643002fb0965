// char_mlp: a byte-level MLP language model (Bengio et al. 2003) trained on real English text
// with dtensor's local ops — forward, hand-written backward and AdamW, top to bottom.
// It is the demo of the foundation layer; the GPT trainer replaces it as the main job.
//
//   char_mlp [--text PATH] [--steps N] [--batch B] [--context T] [--lr LR] [--seed S] [--cuda]
//
// Legend: B batch rows, T context bytes, C embedding width, H hidden width, V = 256 byte values.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"

namespace {

using namespace dtensor;

struct Flags {
  std::string text = "/usr/share/games/fortunes";  // a file, or a folder of text files
  int steps = 3000;
  int batch = 64;
  int context = 8;
  int embd = 24;
  int hidden = 256;
  double lr = 3e-3;
  uint64_t seed = 1337;
  bool cuda = false;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* name) -> const char* {
      if (std::strcmp(argv[i], name) != 0) return nullptr;
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (const char* v = next("--text")) {
      f->text = v;
    } else if (const char* v = next("--steps")) {
      f->steps = std::atoi(v);
    } else if (const char* v = next("--batch")) {
      f->batch = std::atoi(v);
    } else if (const char* v = next("--context")) {
      f->context = std::atoi(v);
    } else if (const char* v = next("--lr")) {
      f->lr = std::atof(v);
    } else if (const char* v = next("--seed")) {
      f->seed = std::strtoull(v, nullptr, 10);
    } else if (std::strcmp(argv[i], "--cuda") == 0) {
      f->cuda = true;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return false;
    }
  }
  return f->steps > 0 && f->batch > 0 && f->context > 0;
}

// Every fallible call in this example goes through Check: print the status and stop.
template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct Param {
  Tensor w, grad, m, v;
};

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  const Device dev = flags.cuda ? Device::Cuda(0) : Device::Cpu();
  const int64_t B = flags.batch, T = flags.context, C = flags.embd, H = flags.hidden, V = 256;

  // ---- Data: the bytes of real English text (Debian's fortune files by default) ----
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  if (std::filesystem::is_directory(flags.text, ec)) {
    for (const auto& e : std::filesystem::directory_iterator(flags.text, ec)) {
      const auto ext = e.path().extension();
      if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(flags.text);
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read %s (scripts/setup.sh installs the fortunes package)\n", f.c_str());
      return 1;
    }
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (static_cast<int64_t>(text.size()) <= T + 1) {
    std::fprintf(stderr, "%s is too short\n", flags.text.c_str());
    return 1;
  }
  std::printf("text: %s (%zu files), %zu bytes; model: context %ld, embd %ld, hidden %ld; device %s\n",
              flags.text.c_str(), files.size(), text.size(), T, C, H, dev.ToString().c_str());

  // ---- Parameters: embedding table, two linear layers (GPT-2-style init) ----
  auto param = [&](std::initializer_list<int64_t> shape, double std, uint64_t seed) {
    Param p;
    const std::vector<int64_t> s(shape);
    p.w = std > 0 ? Check(RandomNormal(s, DType::kFloat32, seed, 0.0, std, dev), "init")
                  : Check(Zeros(s, DType::kFloat32, dev), "init");
    p.grad = Check(Zeros(s, DType::kFloat32, dev), "grad");
    p.m = Check(Zeros(s, DType::kFloat32, dev), "m");
    p.v = Check(Zeros(s, DType::kFloat32, dev), "v");
    return p;
  };
  Param wte = param({V, C}, 0.1, flags.seed);          // [V, C]
  Param w1 = param({T * C, H}, 0.02, flags.seed + 1);  // [T*C, H]
  Param b1 = param({H}, 0.0, 0);                       // [H]
  Param w2 = param({H, V}, 0.02, flags.seed + 2);      // [H, V]
  Param b2 = param({V}, 0.0, 0);                       // [V]
  std::vector<Param*> params = {&wte, &w1, &b1, &w2, &b2};

  // ---- Training: sequential batches of (T context bytes -> next byte) ----
  std::vector<int32_t> ctx(B * T), tgt(B);
  size_t cursor = 0;
  double loss_sum = 0;  // mean loss over the steps since the last print
  int loss_count = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 1; step <= flags.steps; ++step) {
    for (int64_t b = 0; b < B; ++b) {
      if (cursor + T + 1 > text.size()) cursor = 0;
      for (int64_t t = 0; t < T; ++t) ctx[b * T + t] = static_cast<unsigned char>(text[cursor + t]);
      tgt[b] = static_cast<unsigned char>(text[cursor + T]);
      cursor += T + 1;
    }
    Tensor ids = Check(To(Check(Tensor::FromVector<int32_t>(ctx, {B, T}), "ids"), dev), "ids");       // [B, T]
    Tensor targets = Check(To(Check(Tensor::FromVector<int32_t>(tgt, {B}), "tgt"), dev), "targets");  // [B]

    // Forward.
    Tensor emb = Check(Embedding(wte.w, ids), "embedding");                 // [B, T, C]
    Tensor x = Check(Reshape(emb, {B, T * C}), "reshape");                  // [B, T*C]
    Tensor h = Check(Add(Check(Matmul(x, w1.w), "fc1"), b1.w), "b1");       // [B, H]
    Tensor a = Check(Gelu(h), "gelu");                                      // [B, H]
    Tensor logits = Check(Add(Check(Matmul(a, w2.w), "fc2"), b2.w), "b2");  // [B, V]
    CrossEntropyOutput ce = Check(CrossEntropy(logits, targets), "loss");
    const double loss = Check(ToDoubleVector(ce.loss), "loss")[0];

    // Backward, layer by layer in reverse.
    Tensor one = Check(Full({}, 1.0, DType::kFloat32, dev), "dloss");
    Tensor dlogits = Check(CrossEntropyBackward(one, logits, targets, ce), "dlogits");  // [B, V]
    Check(MatmulInto(a, dlogits, w2.grad, /*trans_a=*/true), "dW2");                    // [H, V]
    Check(Copy_(b2.grad, Check(Sum(dlogits, {0}), "db2")), "db2");                      // [V]
    Tensor da = Check(Matmul(dlogits, w2.w, false, /*trans_b=*/true), "da");            // [B, H]
    Tensor dh = Check(UnaryBackward(UnaryOp::kGelu, da, h), "dgelu");                   // [B, H]
    Check(MatmulInto(x, dh, w1.grad, /*trans_a=*/true), "dW1");                         // [T*C, H]
    Check(Copy_(b1.grad, Check(Sum(dh, {0}), "db1")), "db1");                           // [H]
    Tensor dx = Check(Matmul(dh, w1.w, false, /*trans_b=*/true), "dx");                 // [B, T*C]
    Check(Fill_(wte.grad, 0.0), "zero dwte");
    Check(EmbeddingBackward_(wte.grad, Check(Reshape(dx, {B, T, C}), "dx"), ids), "dwte");  // [V, C]

    // AdamW.
    AdamWParams opt;
    opt.lr = static_cast<float>(flags.lr);
    opt.weight_decay = 0.0f;
    opt.step = step;
    for (Param* p : params) Check(AdamWStep_(p->w, p->grad, p->m, p->v, opt), "adamw");

    loss_sum += loss;
    ++loss_count;
    if (step == 1 || step % 250 == 0 || step == flags.steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("step %5d  loss %.4f (mean of last %d)  tokens/s %.0f\n", step, loss_sum / loss_count, loss_count,
                  step * B / secs);
      loss_sum = 0;
      loss_count = 0;
    }
  }

  // ---- Sample: feed the model its own output, temperature 1 ----
  std::string out = "The ";
  uint64_t rng = flags.seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;  // spread small seeds
  for (int i = 0; i < 200; ++i) {
    std::vector<int32_t> window(T, ' ');
    for (int64_t t = 0; t < T && t < static_cast<int64_t>(out.size()); ++t) {
      window[T - 1 - t] = static_cast<unsigned char>(out[out.size() - 1 - t]);
    }
    Tensor ids = Check(To(Check(Tensor::FromVector<int32_t>(window, {1, T}), "ids"), dev), "ids");
    Tensor x = Check(Reshape(Check(Embedding(wte.w, ids), "emb"), {1, T * C}), "x");
    Tensor h = Check(Gelu(Check(Add(Check(Matmul(x, w1.w), "fc1"), b1.w), "b1")), "gelu");
    Tensor probs = Check(Softmax(Check(Add(Check(Matmul(h, w2.w), "fc2"), b2.w), "b2")), "softmax");
    const std::vector<double> p = Check(ToDoubleVector(probs), "probs");
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    double u = static_cast<double>(rng >> 11) * (1.0 / 9007199254740992.0), acc = 0;
    int next = V - 1;
    for (int v = 0; v < V; ++v) {
      acc += p[v];
      if (u < acc) {
        next = v;
        break;
      }
    }
    out.push_back(static_cast<char>(next));
  }
  std::printf("---- sample ----\n");
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::printf("\n----------------\n");
  return 0;
}
