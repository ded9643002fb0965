#!/usr/bin/python3
"""Makes gpt2_tiny.safetensors: golden tensors of a tiny nanoGPT-style GPT-2 from PyTorch.

Run with Debian's python3-torch (1.13):  /usr/bin/python3 tests/golden/make_gpt_golden.py
The file holds (all float32 unless noted):
  <param>            every parameter by state_dict name (wte once; lm_head is tied to it)
  tokens             int64 [B, T+1]; inputs = tokens[:, :-1], targets = tokens[:, 1:]
  logits             [B, T, V] and loss (0-d): mean cross entropy over all B*T tokens
  grad.<param>       d loss / d param (wte: embedding + LM head contributions)
  step1.<param>      the parameters after one torch.optim.AdamW step
and metadata with the config and the AdamW hyperparameters. The script also runs the same
parameters in float64 and prints how far the float32 results are from it (nothing stored).
The output is byte-identical across runs (deterministic init, ordered header, single thread).
"""

import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 61, 12, 2, 2, 16
B, T = 3, 10  # T < BLOCK on purpose
SEED = 1234
INIT_STD = 0.02
NOISE_STD = 0.1  # added to every bias and LayerNorm weight (1 + noise) so their gradients matter
LN_EPS = 1e-5
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD, bias=True)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=True)
        mask = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)).view(1, 1, BLOCK, BLOCK)
        self.register_buffer("mask", mask, persistent=False)  # not in the state_dict

    def forward(self, x):
        b, t, c = x.size()
        d = c // N_HEAD
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q = q.view(b, t, N_HEAD, d).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, N_HEAD, d).transpose(1, 2)
        v = v.view(b, t, N_HEAD, d).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=True)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=True)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD, eps=LN_EPS)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD, eps=LN_EPS)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, N_EMBD),
                wpe=nn.Embedding(BLOCK, N_EMBD),
                h=nn.ModuleList([Block() for _ in range(N_LAYER)]),
                ln_f=nn.LayerNorm(N_EMBD, eps=LN_EPS),
            )
        )
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * N_LAYER))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def param_names(model):
    """state_dict names of the parameters, wte once, no lm_head.weight."""
    return [n for n in model.state_dict().keys() if n != "lm_head.weight"]


def write_safetensors(path, tensors, metadata):
    """Minimal safetensors writer: tensors is a list of (name, tensor); written atomically."""
    dtypes = {torch.float32: "F32", torch.int64: "I64"}
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name, t in tensors:
        data = t.detach().contiguous().cpu().numpy().tobytes()  # little-endian host
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    logits, loss = model(inputs, targets)
    loss.backward()
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.detach().clone() for n in param_names(model)}
    return logits.detach(), loss.detach(), grads


def max_diffs(a32, a64):
    """(max abs diff, max abs diff / max |a64|) of a float32 result against float64."""
    d = (a32.double() - a64).abs().max().item()
    scale = a64.abs().max().item()
    return d, d / scale if scale > 0 else 0.0


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    model = GPT()
    with torch.no_grad():
        for name, p in model.named_parameters():  # lm_head.weight is wte (named_parameters dedups)
            if name.endswith(".bias"):
                p.add_(torch.randn_like(p) * NOISE_STD)
            elif "ln_" in name and name.endswith(".weight"):
                p.add_(torch.randn_like(p) * NOISE_STD)  # LayerNorm weights were 1: now 1 + noise
    tokens = torch.randint(0, VOCAB, (B, T + 1), dtype=torch.int64)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    names = param_names(model)
    params = dict(model.named_parameters())
    assert sorted(names) == sorted(params.keys()), (names, list(params.keys()))

    # float64 reference with the same parameters (deep copy, cast).
    model64 = GPT()
    model64.load_state_dict(model.state_dict())
    model64.double()
    logits64, loss64, grads64 = run(model64, inputs, targets)

    logits, loss, grads = run(model, inputs, targets)
    print(f"loss fp32 {loss.item():.9f}  fp64 {loss64.item():.12f}  |diff| {abs(loss.double().item() - loss64.item()):.3e}")
    d, r = max_diffs(logits, logits64)
    print(f"logits: max |fp32 - fp64| {d:.3e} (relative to max |logit| {r:.3e})")
    worst = max(((max_diffs(grads[n], grads64[n]), n) for n in names), key=lambda x: x[0][1])
    for n in names:
        gd, gr = max_diffs(grads[n], grads64[n])
        print(f"grad {n:40s} max|diff| {gd:.3e}  rel-to-max {gr:.3e}")
    print(f"worst gradient (relative to its max): {worst[1]} {worst[0][1]:.3e}")

    stored = [(n, params[n].detach().clone()) for n in names]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    opt.step()
    step1 = [(f"step1.{n}", params[n].detach().clone()) for n in names]

    tensors = stored + [("tokens", tokens), ("logits", logits), ("loss", loss)]
    tensors += [(f"grad.{n}", grads[n]) for n in names] + step1
    metadata = {
        "description": "nanoGPT-style GPT-2, tied wte/lm_head, tanh GELU, pre-LN; see make_gpt_golden.py",
        "vocab_size": str(VOCAB),
        "block_size": str(BLOCK),
        "n_layer": str(N_LAYER),
        "n_head": str(N_HEAD),
        "n_embd": str(N_EMBD),
        "batch_size": str(B),
        "seq_len": str(T),
        "layer_norm_eps": repr(LN_EPS),
        "seed": str(SEED),
        "adamw_lr": repr(LR),
        "adamw_beta1": repr(BETAS[0]),
        "adamw_beta2": repr(BETAS[1]),
        "adamw_eps": repr(EPS),
        "adamw_weight_decay": repr(WEIGHT_DECAY),
        "adamw_weight_decay_params": "all",
        "torch_version": torch.__version__,
    }
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_tiny.safetensors")
    if len(sys.argv) > 1:
        out = sys.argv[1]
    write_safetensors(out, tensors, metadata)
    print(f"wrote {out}: {len(tensors)} tensors, {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()
