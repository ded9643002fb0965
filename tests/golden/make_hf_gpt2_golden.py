#!/usr/bin/python3
"""Makes hf_gpt2_tiny/: a tiny GPT-2 in Hugging Face's layout and golden outputs of its forward.

Run with Debian's python3-torch (1.13):  /usr/bin/python3 tests/golden/make_hf_gpt2_golden.py
No transformers package is used: GPT2LMHeadModel's forward is written out below from its
definition, independently of dtensor's nn::GPT (whose weights are nn.Linear [out, in]):
  Conv1D          y = x @ W + b with W stored [in, out] (attn.c_attn, attn.c_proj, mlp.c_fc,
                  mlp.c_proj)
  gelu_new        0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
  LayerNorm       (x - mean) / sqrt(biased var + layer_norm_epsilon) * w + b
  attention       softmax(q k^T / sqrt(head_dim), causal: the attn.bias mask buffer) v
  block           x + attn(ln_1(x)), then + mlp(ln_2(x))
  lm_head         tied to wte: logits = ln_f(x) @ wte^T
The reference runs in float64 on the float32 weights; results are stored as float32.

Writes, in tests/golden/hf_gpt2_tiny/:
  model.safetensors  the weights as the hub's gpt2 file has them: GPT2Model names without the
                     "transformer." prefix (wte.weight, h.0.attn.c_attn.weight [C, 3C], ...),
                     no lm_head.weight (tied), and the causal-mask buffers h.N.attn.bias
                     [1, 1, n_positions, n_positions] (float32 ones on and below the diagonal);
                     metadata {"format": "pt"}
  config.json        GPT2Config's fields for this model
  golden.safetensors input_ids int64 [B, T]; logits [B, T, V]; hidden.embed (wte + wpe),
                     hidden.block.<i> (each block's output), hidden.ln_f ([B, T, C] each);
                     prompt int64 [P] and greedy int64 [NEW] (argmax continuation, the whole
                     sequence recomputed for every new token); greedy_margin float32 [NEW]
                     (top-1 minus top-2 logit at each step, so a reader sees how far from a tie)
The output is byte-identical across runs (seeded, ordered headers, one thread).

  make_hf_gpt2_golden.py --check-export DIR
reads DIR/model.safetensors as GPT2LMHeadModel.save_pretrained writes it ("transformer."
names, Conv1D [in, out], F32, no lm_head.weight, metadata format "pt"; tests/gpt/hf_gpt2_test.cc
writes it with WriteHfGpt2), runs the forward above on the golden input_ids and exits 0 when
the logits match golden.safetensors within 1e-5 (max |diff| / max |golden|), 1 otherwise.
"""

import json
import math
import os
import struct
import sys

import torch

sys.dont_write_bytecode = True  # no __pycache__ in tests/golden
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gpt_golden import write_safetensors  # noqa: E402  (F32 / I64, atomic)

CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 96,
    "embd_pdrop": 0.1,
    "eos_token_id": 96,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 48,
    "n_embd": 32,
    "n_head": 4,
    "n_inner": None,
    "n_layer": 3,
    "n_positions": 48,
    "reorder_and_upcast_attn": False,
    "resid_pdrop": 0.1,
    "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 97,
}
B, T = 2, 16  # the batch for logits and per-layer outputs (T < n_positions on purpose)
PROMPT, NEW = 8, 32  # greedy continuation: 8 prompt tokens, 32 new ones (40 <= n_positions)
SEED = 20240607
WEIGHT_STD = 0.5  # large enough that the greedy continuation varies (20 distinct tokens of 32)
NOISE_STD = 0.1  # biases ~ N(0, 0.1), LayerNorm weights 1 + N(0, 0.1): they all matter


def make_weights():
    """HF hub-style (GPT2Model) names -> float32 tensors, in GPT2Model's state_dict order."""
    g = torch.Generator().manual_seed(SEED)
    c, v, p, n_layer = CONFIG["n_embd"], CONFIG["vocab_size"], CONFIG["n_positions"], CONFIG["n_layer"]

    def normal(*shape, std=WEIGHT_STD, mean=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean).contiguous()

    w = [("wte.weight", normal(v, c)), ("wpe.weight", normal(p, c, std=0.5))]
    mask = torch.tril(torch.ones(p, p, dtype=torch.float32)).view(1, 1, p, p)
    for i in range(n_layer):
        h = f"h.{i}."
        w += [
            (h + "ln_1.weight", normal(c, std=NOISE_STD, mean=1.0)),
            (h + "ln_1.bias", normal(c, std=NOISE_STD)),
            (h + "attn.bias", mask.clone()),  # the causal-mask buffer, as in the hub's file
            (h + "attn.c_attn.weight", normal(c, 3 * c)),  # Conv1D: [in, out]
            (h + "attn.c_attn.bias", normal(3 * c, std=NOISE_STD)),
            (h + "attn.c_proj.weight", normal(c, c)),
            (h + "attn.c_proj.bias", normal(c, std=NOISE_STD)),
            (h + "ln_2.weight", normal(c, std=NOISE_STD, mean=1.0)),
            (h + "ln_2.bias", normal(c, std=NOISE_STD)),
            (h + "mlp.c_fc.weight", normal(c, 4 * c)),
            (h + "mlp.c_fc.bias", normal(4 * c, std=NOISE_STD)),
            (h + "mlp.c_proj.weight", normal(4 * c, c, std=WEIGHT_STD / 2)),
            (h + "mlp.c_proj.bias", normal(c, std=NOISE_STD)),
        ]
    w += [("ln_f.weight", normal(c, std=NOISE_STD, mean=1.0)), ("ln_f.bias", normal(c, std=NOISE_STD))]
    return w


def layer_norm(x, weight, bias):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as torch.nn.LayerNorm
    return (x - mean) / torch.sqrt(var + CONFIG["layer_norm_epsilon"]) * weight + bias


def conv1d(x, weight, bias):
    return x @ weight + bias  # weight [in, out]


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def attention(x, w, h):
    b, t, c = x.shape
    nh = CONFIG["n_head"]
    d = c // nh
    q, k, v = conv1d(x, w[h + "attn.c_attn.weight"], w[h + "attn.c_attn.bias"]).split(c, dim=2)
    q, k, v = (z.view(b, t, nh, d).permute(0, 2, 1, 3) for z in (q, k, v))  # [B, H, T, D]
    att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    causal = w[h + "attn.bias"][:, :, :t, :t].bool()
    att = torch.where(causal, att, torch.tensor(torch.finfo(att.dtype).min, dtype=att.dtype))
    att = torch.softmax(att, dim=-1)
    y = (att @ v).permute(0, 2, 1, 3).reshape(b, t, c)
    return conv1d(y, w[h + "attn.c_proj.weight"], w[h + "attn.c_proj.bias"])


def forward(ids, w):
    """GPT2LMHeadModel's forward in inference mode: (logits, [embed, block 0.., ln_f])."""
    t = ids.shape[1]
    x = w["wte.weight"][ids] + w["wpe.weight"][torch.arange(t)]
    hidden = [x]
    for i in range(CONFIG["n_layer"]):
        h = f"h.{i}."
        x = x + attention(layer_norm(x, w[h + "ln_1.weight"], w[h + "ln_1.bias"]), w, h)
        m = layer_norm(x, w[h + "ln_2.weight"], w[h + "ln_2.bias"])
        m = conv1d(gelu_new(conv1d(m, w[h + "mlp.c_fc.weight"], w[h + "mlp.c_fc.bias"])), w[h + "mlp.c_proj.weight"],
                   w[h + "mlp.c_proj.bias"])
        x = x + m
        hidden.append(x)
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    hidden.append(x)
    return x @ w["wte.weight"].t(), hidden


def read_safetensors(path):
    """(name -> tensor, metadata) of a safetensors file with F32 / I64 tensors."""
    dtypes = {"F32": torch.float32, "I64": torch.int64}
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        raw = bytearray(data[8 + n + begin:8 + n + end])
        tensors[name] = torch.frombuffer(raw, dtype=dtypes[e["dtype"]]).view(e["shape"])
    return tensors, metadata


def check_export(export_dir):
    golden_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_gpt2_tiny")
    golden, _ = read_safetensors(os.path.join(golden_dir, "golden.safetensors"))
    tensors, metadata = read_safetensors(os.path.join(export_dir, "model.safetensors"))
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    problems = []
    if metadata.get("format") != "pt":
        problems.append(f"metadata {metadata}: transformers needs format pt")
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
                "activation_function"):
        if config.get(key) != CONFIG[key]:
            problems.append(f"config.json {key} = {config.get(key)}, expected {CONFIG[key]}")
    w = {}
    for name, t in tensors.items():
        if not name.startswith("transformer.") or t.dtype != torch.float32:
            problems.append(f"tensor {name} ({t.dtype}): expected a transformer.* F32 tensor")
        w[name[len("transformer."):]] = t.double()
    expected = {n: list(t.shape) for n, t in make_weights() if not n.endswith(".attn.bias")}
    if {n: list(t.shape) for n, t in w.items()} != expected:
        problems.append(f"names/shapes {sorted(w)} differ from GPT2LMHeadModel's {sorted(expected)}")
    if not problems:
        p = CONFIG["n_positions"]
        for i in range(CONFIG["n_layer"]):
            w[f"h.{i}.attn.bias"] = torch.tril(torch.ones(p, p, dtype=torch.float64)).view(1, 1, p, p)
        with torch.no_grad():
            logits, _ = forward(golden["input_ids"], w)
        rel = ((logits - golden["logits"].double()).abs().max() / golden["logits"].abs().max()).item()
        print(f"exported logits vs golden: max |diff| / max |golden| = {rel:.3e}")
        if not rel <= 1e-5:
            problems.append(f"logits differ: {rel:.3e}")
    for p in problems:
        print("problem:", p)
    return 1 if problems else 0


def main():
    torch.set_num_threads(1)
    if len(sys.argv) == 3 and sys.argv[1] == "--check-export":
        sys.exit(check_export(sys.argv[2]))
    torch.use_deterministic_algorithms(True)
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                  "hf_gpt2_tiny")
    os.makedirs(out_dir, exist_ok=True)
    weights = make_weights()
    w64 = {n: t.double() for n, t in weights}
    w32 = dict(weights)

    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=g, dtype=torch.int64)
    with torch.no_grad():
        logits, hidden = forward(ids, w64)
        logits32, _ = forward(ids, w32)
        rel = ((logits32.double() - logits).abs().max() / logits.abs().max()).item()
        print(f"logits: max |fp32 - fp64| / max |fp64| = {rel:.3e}")

        prompt = torch.randint(0, CONFIG["vocab_size"], (PROMPT,), generator=g, dtype=torch.int64)
        seq = prompt.clone()
        margins = []
        for _ in range(NEW):
            step_logits, _ = forward(seq.view(1, -1), w64)
            last = step_logits[0, -1]
            top2 = torch.topk(last, 2).values
            margins.append((top2[0] - top2[1]).item())
            seq = torch.cat([seq, last.argmax().view(1)])
        greedy = seq[PROMPT:].clone()
        print(f"greedy: {greedy.tolist()}; smallest top-1 minus top-2 logit {min(margins):.3e}")
        assert min(margins) > 1e-3, "a near tie in the greedy continuation: pick another SEED"

    golden = [("input_ids", ids), ("logits", logits.float())]
    golden += [("hidden.embed", hidden[0].float())]
    golden += [(f"hidden.block.{i}", hidden[1 + i].float()) for i in range(CONFIG["n_layer"])]
    golden += [("hidden.ln_f", hidden[-1].float()), ("prompt", prompt), ("greedy", greedy),
               ("greedy_margin", torch.tensor(margins, dtype=torch.float32))]
    meta = {"description": "GPT2LMHeadModel forward (float64) on hf_gpt2_tiny/model.safetensors; see "
                           "make_hf_gpt2_golden.py", "seed": str(SEED), "torch_version": torch.__version__}
    write_safetensors(os.path.join(out_dir, "model.safetensors"), weights, {"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path + ".tmp", "w") as f:
        f.write(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(config_path + ".tmp", config_path)
    write_safetensors(os.path.join(out_dir, "golden.safetensors"), golden, meta)
    for name in ("model.safetensors", "config.json", "golden.safetensors"):
        print(f"wrote {os.path.join(out_dir, name)}: {os.path.getsize(os.path.join(out_dir, name))} bytes")


if __name__ == "__main__":
    main()
