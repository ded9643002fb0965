#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets, tests/fuzz/corpus/<target>/ (small files).

Usage: scripts/make_fuzz_corpus.py [out_dir]   (default: tests/fuzz/corpus beside this script)

Each seed is a valid input of its format written from the format's description (the headers of
nn/safetensors.h, examples/gpt/llmc.h and data.h, collectives/store/tcp_store.cc,
dtensor/checkpoint/checkpoint.h), plus a few near-misses, so that the fuzzers start past the
first checks. Standard library only; the output is deterministic.
"""
import json
import os
import struct
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def bf16(values):
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def ramp(n, scale=0.01):
    return [((i * 7) % 13 - 6) * scale for i in range(n)]


# ---- safetensors (nn/safetensors.h) and the Hugging Face GPT-2 reader ----
# The tiny GPT-2 of safetensors_fuzz.cc's config: V=8, P=4, C=4, 1 layer.
V, P, C = 8, 4, 4


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def gpt2_tensors(prefix, enc, dtype):
    shapes = [("wte.weight", [V, C]), ("wpe.weight", [P, C])]
    h = "h.0."
    shapes += [(h + "ln_1.weight", [C]), (h + "ln_1.bias", [C]),
               (h + "attn.c_attn.weight", [C, 3 * C]), (h + "attn.c_attn.bias", [3 * C]),
               (h + "attn.c_proj.weight", [C, C]), (h + "attn.c_proj.bias", [C]),
               (h + "ln_2.weight", [C]), (h + "ln_2.bias", [C]),
               (h + "mlp.c_fc.weight", [C, 4 * C]), (h + "mlp.c_fc.bias", [4 * C]),
               (h + "mlp.c_proj.weight", [4 * C, C]), (h + "mlp.c_proj.bias", [C]),
               ("ln_f.weight", [C]), ("ln_f.bias", [C])]
    out = []
    for name, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append((prefix + name, dtype, shape, enc(ramp(n))))
    return out


put("safetensors", "gpt2_model_f32", safetensors(gpt2_tensors("", f32, "F32")))
put("safetensors", "gpt2_lmhead_bf16", safetensors(gpt2_tensors("transformer.", bf16, "BF16"), {"format": "pt"}))
put("safetensors", "dtypes", safetensors([
    ("f32", "F32", [2, 3], f32(ramp(6))),
    ("i64", "I64", [3], struct.pack("<3q", -1, 0, 1 << 40)),
    ("i32", "I32", [], struct.pack("<i", 7)),
    ("b", "BOOL", [4], bytes([0, 1, 1, 0])),
    ("f16", "F16", [2], struct.pack("<2e", 1.5, -2.0)),
    ("e4m3", "F8_E4M3", [2], bytes([0x38, 0xb8])),
    ("empty", "F32", [0, 5], b""),
], {"step": "100"}))
put("safetensors", "empty_header", struct.pack("<Q", 8) + b"{}      ")

# ---- llm.c checkpoints (examples/gpt/llmc.h) ----
MAXT, LV, VP, L, NH, LC = 4, 5, 8, 1, 1, 4


def llmc_params(version):
    counts = [VP * LC, MAXT * LC, L * LC, L * LC, L * 3 * LC * LC, L * 3 * LC, L * LC * LC, L * LC, L * LC, L * LC,
              L * 4 * LC * LC, L * 4 * LC, L * LC * 4 * LC, L * LC, LC, LC]
    enc = f32 if version == 3 else bf16
    return b"".join(enc(ramp(n)) for n in counts)


def llmc_header(version, maxt=MAXT, v=LV, l=L, nh=NH, c=LC, vp=VP, magic=20240326):
    words = [magic, version, maxt, v, l, nh, c, vp] + [0] * 248
    return struct.pack("<256i", *words)


put("llmc_checkpoint", "tiny_v3", llmc_header(3) + llmc_params(3))
put("llmc_checkpoint", "tiny_v5_bf16", llmc_header(5) + llmc_params(5))
put("llmc_checkpoint", "header_only", llmc_header(3))
put("llmc_checkpoint", "version_2", llmc_header(2) + llmc_params(3))

# ---- llm.c token files (examples/gpt/data.h) ----
tokens = [50256, 15496, 995, 0, 1, 65535, 256, 50256]
put("llmc_tokens", "eight_tokens", struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)) +
    struct.pack("<%dH" % len(tokens), *tokens))
put("llmc_tokens", "one_token", struct.pack("<256i", 20240520, 1, 1, *([0] * 253)) + struct.pack("<H", 7))
put("llmc_tokens", "text", "Hello, world.\n")

# ---- store requests (collectives/store/tcp_store.cc's wire format) ----
MAGIC = 0x31535444


def request(op, fields):
    out = struct.pack("<IBI", MAGIC, op, len(fields))
    for f in fields:
        out += struct.pack("<Q", len(f)) + f
    return out


SET = request(1, [b"nccl/id", b"\x00\x01\x02value"])
GET = request(2, [b"nccl/id"])
ADD = request(3, [b"barrier/0", struct.pack("<q", 1)])
WAIT = request(4, [b"rank/0", b"rank/1", b"rank/2"])
put("store_request", "set", SET)
put("store_request", "get", GET)
put("store_request", "add", ADD)
put("store_request", "wait", WAIT)
put("store_request", "pipelined", SET + ADD + GET + WAIT + GET[:11])

# ---- placement, style and activation-checkpoint texts (nn/parallel) ----
for i, text in enumerate(["S(0)", "S(-1)", "R", "P(sum)", "P(max)", "ColwiseParallel", "ColwiseParallel(fused=3)",
                          "RowwiseParallel(output=S(1))", "SequenceParallel(dim=1)",
                          "PrepareModuleInput(input=S(1), desired=R)",
                          "PrepareModuleOutput(output=P(sum), desired=R)", "selective:2", "selective:op", "full"]):
    put("parallel_style", "text_%02d" % i, text)

# ---- plan files (nn/parallel/plan_file.h) ----
with open(os.path.join(ROOT, "examples", "gpt", "plans", "gpt_tp.json"), "rb") as f:
    put("plan_file", "gpt_tp.json", f.read())
put("plan_file", "mesh_only.json", json.dumps({"mesh": {"dp_shard": -1, "tp": 2}, "rules": []}))
put("plan_file", "param_rule.json", json.dumps({"mesh": {"dp_replicate": 2, "tp": 2}, "rules": [
    {"param": "transformer.wpe.weight", "placements": {"tp": "R"}},
    {"module": "transformer.h.*.mlp.c_fc", "style": "ColwiseParallel"}]}))

# ---- checkpoint metadata + data (dtensor/checkpoint/checkpoint.h; checkpoint_metadata_fuzz.cc) ----
BLOCK = 16


def checkpoint(split_a):
    data, tensors = b"", {}

    def piece(name, shape, dtype, offset, box, raw):
        nonlocal data
        crcs = [zlib.crc32(raw[i:i + BLOCK]) for i in range(0, len(raw), BLOCK)]
        t = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
        t["pieces"].append({"offset": offset, "box": box, "file": "rank-00000.bin", "file_offset": len(data),
                            "bytes": len(raw), "crc32": crcs})
        data += raw

    a = f32(ramp(12))
    if split_a:
        piece("a", [4, 3], "float32", [0, 0], [2, 3], a[:24])
        piece("a", [4, 3], "float32", [2, 0], [2, 3], a[24:])
    else:
        piece("a", [4, 3], "float32", [0, 0], [4, 3], a)
    piece("b", [5], "int64", [0], [5], struct.pack("<5q", 1, -2, 3, 1 << 33, 0))
    piece("c", [6, 2], "float32", [0, 0], [6, 2], f32(ramp(12, 0.5)))
    meta = {"format": "dtensor-checkpoint", "version": 1, "block_bytes": BLOCK, "tensors": tensors}
    return json.dumps(meta, indent=1).encode() + b"\x00" + data


put("checkpoint_metadata", "whole", checkpoint(False))
put("checkpoint_metadata", "split", checkpoint(True))

# ---- tokenizer (examples/gpt/tokenizer.h): text, and int32 ids ----
put("tokenizer", "hello", "Hello world, it's 2024!\n\n  the end")
put("tokenizer", "unicode", "na\u00efve caf\u00e9 \u4e2d\u6587\u5b57 \U0001f600 \u0394x=1\u00b2")
put("tokenizer", "invalid_utf8", b"ab\xff\xfe\xc0\xafcd\xed\xa0\x80 \xf4\x90\x80\x80")
put("tokenizer", "ids", struct.pack("<6i", 15496, 995, 50256, 0, 255, 11))

# ---- Hugging Face GPT-2 config.json ----
put("hf_config", "gpt2.json", json.dumps({
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "scale_attn_weights": True, "tie_word_embeddings": True,
    "vocab_size": 50257}, indent=2))
put("hf_config", "tiny.json", json.dumps({"model_type": "gpt2", "vocab_size": 8, "n_positions": 4, "n_embd": 4,
                                          "n_layer": 1, "n_head": 1}))
