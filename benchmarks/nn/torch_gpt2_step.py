#!/usr/bin/python3
# torch_gpt2_step.py: PyTorch's CPU training step on the model gpt_train builds with
# --model gpt2, for benchmarks/nn/cpu_step_compare.sh to set beside it.
#
#   OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 benchmarks/nn/torch_gpt2_step.py [--batch 4] [--seq 64]
#       [--steps 5] [--warmup 2] [--vocab 50304] [--n-layer 12] [--n-head 12] [--n-embd 768]
#
# The model is nn/gpt.h's (nanoGPT's GPT-2): learned token and position embeddings (block size
# 1024, as GPT-2's), pre-LN blocks of causal self-attention (fused c_attn, c_proj) and a tanh-GELU
# MLP (c_fc 4C, c_proj), biases everywhere, final LayerNorm, an LM head tied to the token
# embedding, no dropout; GPT-2's initialisation. A step is what gpt_train times: zero the
# gradients, forward with the mean cross-entropy, backward, AdamW (gpt_train's defaults: lr 1e-3,
# betas 0.9/0.999, eps 1e-8, no weight decay, no clipping), read the loss. Written for Debian's
# python3-torch 1.13: no scaled_dot_product_attention and no fused AdamW there, so attention is
# nanoGPT's explicit path (Q K^T, mask, softmax, P V) and AdamW is torch.optim.AdamW's per-tensor
# loop, 1.13's default (--foreach true took 1.5-3x longer per update here: its temporaries span
# every parameter at once). Tuned: OMP_WAIT_POLICY=PASSIVE in the environment (it must be set
# before torch loads its OpenMP runtime: the caller's job), torch.set_num_threads(nproc),
# gradients set to None.
#
# Prints one line per step, then "torch: median_ms M tokens_per_s S params P" over the steps
# after --warmup.
import argparse
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, c, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x):  # x [B, T, C]
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # [B, H, T, T]
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)  # [B, T, C]
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c)
        self.attn = SelfAttention(c, n_head, block_size)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, c):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(block_size, c)
        self.h = nn.ModuleList([Block(c, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(c)
        self.lm_head = nn.Linear(c, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, ids, targets):  # ids, targets [B, T]
        t = ids.size(1)
        x = self.wte(ids) + self.wpe(torch.arange(t, dtype=torch.long))  # [B, T, C]
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser(description="PyTorch's CPU GPT-2 training step (beside gpt_train)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--foreach", choices=["true", "false"], default="false", help="AdamW's multi-tensor update")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    model = GPT(a.vocab, max(a.block_size, a.seq), a.n_layer, a.n_head, a.n_embd)
    model.train()
    params = list(model.parameters())
    n_params = sum(q.numel() for q in params)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            foreach=a.foreach == "true")
    gen = torch.Generator().manual_seed(1337)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {n_params} parameters, "
          f"L={a.n_layer} H={a.n_head} C={a.n_embd} V={a.vocab} B={a.batch} T={a.seq}", flush=True)

    times = []
    for step in range(a.warmup + a.steps):
        # Random tokens (the step's time does not depend on their values).
        data = torch.randint(0, min(a.vocab, 50257), (a.batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
        print(f"step {step:3d}  loss {loss_value:.4f}  time {dt * 1e3:.0f} ms{'' if step >= a.warmup else ' (warmup)'}",
              flush=True)
    if times:
        med = statistics.median(times)
        print(f"torch: median_ms {med * 1e3:.1f} tokens_per_s {a.batch * a.seq / med:.0f} params {n_params}")


if __name__ == "__main__":
    main()
