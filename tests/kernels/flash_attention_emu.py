#!/usr/bin/env python3
# flash_attention_emu.py: checks the index logic of dtensor/kernels/cuda/flash_attention.cu on a
# machine without a GPU. Each kernel's warp-level code is transcribed line by line into numpy
# (per-lane registers as arrays over the 32 lanes, shared tiles as flat arrays with the kernel's
# pitches), with mma.sync.m16n8k16 emulated from the fragment layouts the PTX ISA documents
# ("Matrix Fragments for mma.m16n8k16 with floating point type"), in float64 without rounding;
# the results must equal a plain numpy causal attention and its gradients to ~1e-15. This
# checks fragment layouts, masks, tile bounds and the S -> P register reuse, not the CUDA code
# itself: keep it in step with the kernels when they change, and run the GPU test
# (CudaKernelsTest.FlashAttentionMatchesCpu) where a GPU is available.
#
#   python3 tests/kernels/flash_attention_emu.py        # needs python3-numpy; ~1 minute
import sys

import numpy as np
LANES = np.arange(32); G = LANES >> 2; TT = LANES & 3
kRows = kCols = 64; kTP = kCols + 8
def mma(c, a, b):
    # c [32,4], a [32,4,2], b [32,2,2]
    A = np.zeros((16,16)); B = np.zeros((16,8)); C = np.zeros((16,8))
    for l in range(32):
        g, t = G[l], TT[l]
        for j in range(2):
            A[g, 2*t+j] = a[l,0,j]; A[g+8, 2*t+j] = a[l,1,j]; A[g, 2*t+8+j] = a[l,2,j]; A[g+8, 2*t+8+j] = a[l,3,j]
            B[2*t+j, g] = b[l,0,j]; B[2*t+8+j, g] = b[l,1,j]
            C[g, 2*t+j] = c[l,j]; C[g+8, 2*t+j] = c[l,2+j]
    D = A @ B + C
    out = np.zeros((32,4))
    for l in range(32):
        g, t = G[l], TT[l]
        for j in range(2):
            out[l,j] = D[g, 2*t+j]; out[l,2+j] = D[g+8, 2*t+j]
    return out
def pair(arr, idx):  # arr flat smem, idx [32] element index -> [32,2]
    return np.stack([arr[idx], arr[idx+1]], axis=1)
def loadA(sm, base, pitch, kk):
    r0 = base + G*pitch + 16*kk + 2*TT; r1 = r0 + 8*pitch
    return np.stack([pair(sm, r0), pair(sm, r1), pair(sm, r0+8), pair(sm, r1+8)], axis=1)
def loadB(sm, pitch, n0, k0):
    p = (n0 + G)*pitch + k0 + 2*TT
    return np.stack([pair(sm, p), pair(sm, p+8)], axis=1)
def afromc(c, kk):  # c [8][32,4]
    return np.stack([c[2*kk][:, 0:2], c[2*kk][:, 2:4], c[2*kk+1][:, 0:2], c[2*kk+1][:, 2:4]], axis=1)
def load_tile(head, row0, t_len, D, rm=True, tr=False):
    P = D + 8
    rmt = np.zeros(kCols*P); trt = np.zeros(D*kTP)
    for r in range(kCols):
        if row0 + r < t_len:
            rmt[r*P:r*P+D] = head[row0+r]
            for c in range(D): trt[c*kTP + r] = head[row0+r, c]
    return rmt, trt

def forward(q, k, v, scale):
    BH, T, D = q.shape; P = D + 8
    out = np.zeros_like(q); lse = np.zeros((BH, T))
    sl2 = scale*np.log2(np.e)
    tiles = (T + 63)//64
    for bh in range(BH):
        for by in range(tiles):
            q0 = (tiles - 1 - by)*64
            qs, _ = load_tile(q[bh], q0, T, D)
            for w in range(4):
                qa = [loadA(qs, w*16*P, P, kk) for kk in range(D//16)]
                o = [np.zeros((32,4)) for _ in range(D//8)]
                m_lo = np.full(32, -np.inf); m_hi = np.full(32, -np.inf); l_lo = np.zeros(32); l_hi = np.zeros(32)
                r_lo = q0 + w*16 + G; r_hi = r_lo + 8
                end = min(q0 + 64, T)
                for j0 in range(0, end, 64):
                    ks, _ = load_tile(k[bh], j0, T, D)
                    _, vt = load_tile(v[bh], j0, T, D)
                    s = [np.zeros((32,4)) for _ in range(8)]
                    for n in range(8):
                        for kk in range(D//16):
                            s[n] = mma(s[n], qa[kk], loadB(ks, P, 8*n, 16*kk))
                    mx_lo = np.full(32, -np.inf); mx_hi = np.full(32, -np.inf)
                    for n in range(8):
                        for e in range(4):
                            col = j0 + 8*n + 2*TT + (e & 1)
                            row = r_lo if e < 2 else r_hi
                            ok = (col <= row) & (col < T)
                            s[n][:, e] = np.where(ok, s[n][:, e]*sl2, -np.inf)
                        mx_lo = np.maximum(mx_lo, np.maximum(s[n][:,0], s[n][:,1]))
                        mx_hi = np.maximum(mx_hi, np.maximum(s[n][:,2], s[n][:,3]))
                    for off in (1, 2):
                        mx_lo = np.maximum(mx_lo, mx_lo[LANES ^ off]); mx_hi = np.maximum(mx_hi, mx_hi[LANES ^ off])
                    new_lo = np.maximum(m_lo, mx_lo); new_hi = np.maximum(m_hi, mx_hi)
                    b_lo = np.where(new_lo == -np.inf, 0, new_lo); b_hi = np.where(new_hi == -np.inf, 0, new_hi)
                    c_lo = np.exp2(m_lo - b_lo); c_hi = np.exp2(m_hi - b_hi)
                    m_lo, m_hi = new_lo, new_hi
                    su_lo = np.zeros(32); su_hi = np.zeros(32)
                    for n in range(8):
                        s[n][:,0] = np.exp2(s[n][:,0]-b_lo); s[n][:,1] = np.exp2(s[n][:,1]-b_lo)
                        s[n][:,2] = np.exp2(s[n][:,2]-b_hi); s[n][:,3] = np.exp2(s[n][:,3]-b_hi)
                        su_lo += s[n][:,0]+s[n][:,1]; su_hi += s[n][:,2]+s[n][:,3]
                    l_lo = l_lo*c_lo + su_lo; l_hi = l_hi*c_hi + su_hi
                    for n in range(D//8):
                        o[n][:,0:2] *= c_lo[:,None]; o[n][:,2:4] *= c_hi[:,None]
                    for kk in range(4):
                        pa = afromc(s, kk)
                        for n in range(D//8):
                            o[n] = mma(o[n], pa, loadB(vt, kTP, 8*n, 16*kk))
                for off in (1, 2):
                    l_lo = l_lo + l_lo[LANES ^ off]; l_hi = l_hi + l_hi[LANES ^ off]
                for n in range(D//8):
                    c = 8*n + 2*TT
                    for l in range(32):
                        if r_lo[l] < T: out[bh, r_lo[l], c[l]:c[l]+2] = o[n][l,0:2]/l_lo[l]
                        if r_hi[l] < T: out[bh, r_hi[l], c[l]:c[l]+2] = o[n][l,2:4]/l_hi[l]
                for l in range(32):
                    if TT[l] == 0:
                        if r_lo[l] < T: lse[bh, r_lo[l]] = m_lo[l]*np.log(2) + np.log(l_lo[l])
                        if r_hi[l] < T: lse[bh, r_hi[l]] = m_hi[l]*np.log(2) + np.log(l_hi[l])
    return out, lse

def dkv(dout, q, k, v, lse, delta, scale):
    BH, T, D = q.shape; P = D + 8
    dk = np.zeros_like(q); dv = np.zeros_like(q)
    sl2 = scale*np.log2(np.e); tiles = (T + 63)//64
    for bh in range(BH):
        for by in range(tiles):
            s0 = (tiles - 1 - by)*64
            kst, _ = load_tile(k[bh], s0, T, D); vst, _ = load_tile(v[bh], s0, T, D)
            for w in range(4):
                ka = [loadA(kst, w*16*P, P, kk) for kk in range(D//16)]
                va = [loadA(vst, w*16*P, P, kk) for kk in range(D//16)]
                gk = [np.zeros((32,4)) for _ in range(D//8)]; gv = [np.zeros((32,4)) for _ in range(D//8)]
                k_lo = s0 + w*16 + G; k_hi = k_lo + 8
                for q0 in range(s0, T, 64):
                    qs, qt = load_tile(q[bh], q0, T, D, tr=True)
                    dos, dot = load_tile(dout[bh], q0, T, D, tr=True)
                    tl = np.array([lse[bh, q0+i]*np.log2(np.e) if q0+i < T else 0 for i in range(64)])
                    td = np.array([delta[bh, q0+i] if q0+i < T else 0 for i in range(64)])
                    p = [np.zeros((32,4)) for _ in range(8)]; dp = [np.zeros((32,4)) for _ in range(8)]
                    for n in range(8):
                        for kk in range(D//16):
                            p[n] = mma(p[n], ka[kk], loadB(qs, P, 8*n, 16*kk))
                            dp[n] = mma(dp[n], va[kk], loadB(dos, P, 8*n, 16*kk))
                    for n in range(8):
                        for e in range(4):
                            qi = 8*n + 2*TT + (e & 1)
                            row_q = q0 + qi; key = k_lo if e < 2 else k_hi
                            ok = (row_q >= key) & (row_q < T)
                            pe = np.where(ok, np.exp2(p[n][:,e]*sl2 - tl[qi]), 0)
                            p[n][:,e] = pe; dp[n][:,e] = pe*(dp[n][:,e] - td[qi])
                    for kk in range(4):
                        pa = afromc(p, kk); dsa = afromc(dp, kk)
                        for n in range(D//8):
                            gv[n] = mma(gv[n], pa, loadB(dot, kTP, 8*n, 16*kk))
                            gk[n] = mma(gk[n], dsa, loadB(qt, kTP, 8*n, 16*kk))
                for n in range(D//8):
                    c = 8*n + 2*TT
                    for l in range(32):
                        if k_lo[l] < T: dk[bh, k_lo[l], c[l]:c[l]+2] = gk[n][l,0:2]*scale; dv[bh, k_lo[l], c[l]:c[l]+2] = gv[n][l,0:2]
                        if k_hi[l] < T: dk[bh, k_hi[l], c[l]:c[l]+2] = gk[n][l,2:4]*scale; dv[bh, k_hi[l], c[l]:c[l]+2] = gv[n][l,2:4]
    return dk, dv

def dq_k(dout, q, k, v, lse, delta, scale):
    BH, T, D = q.shape; P = D + 8
    dq = np.zeros_like(q)
    sl2 = scale*np.log2(np.e); tiles = (T + 63)//64
    for bh in range(BH):
        for by in range(tiles):
            q0 = (tiles - 1 - by)*64
            qst, _ = load_tile(q[bh], q0, T, D); dst, _ = load_tile(dout[bh], q0, T, D)
            for w in range(4):
                qa = [loadA(qst, w*16*P, P, kk) for kk in range(D//16)]
                da = [loadA(dst, w*16*P, P, kk) for kk in range(D//16)]
                r_lo = q0 + w*16 + G; r_hi = r_lo + 8
                L2 = lambda r: np.array([lse[bh, x]*np.log2(np.e) if x < T else 0 for x in r])
                DL = lambda r: np.array([delta[bh, x] if x < T else 0 for x in r])
                lse_lo, lse_hi, dl_lo, dl_hi = L2(r_lo), L2(r_hi), DL(r_lo), DL(r_hi)
                acc = [np.zeros((32,4)) for _ in range(D//8)]
                end = min(q0 + 64, T)
                for j0 in range(0, end, 64):
                    ks, kt = load_tile(k[bh], j0, T, D, tr=True); vs, _ = load_tile(v[bh], j0, T, D)
                    p = [np.zeros((32,4)) for _ in range(8)]; ds = [np.zeros((32,4)) for _ in range(8)]
                    for n in range(8):
                        for kk in range(D//16):
                            p[n] = mma(p[n], qa[kk], loadB(ks, P, 8*n, 16*kk))
                            ds[n] = mma(ds[n], da[kk], loadB(vs, P, 8*n, 16*kk))
                    for n in range(8):
                        for e in range(4):
                            col = j0 + 8*n + 2*TT + (e & 1); lo = e < 2
                            row = r_lo if lo else r_hi
                            ok = (col <= row) & (col < T) & (row < T)
                            pe = np.where(ok, np.exp2(p[n][:,e]*sl2 - (lse_lo if lo else lse_hi)), 0)
                            ds[n][:,e] = pe*(ds[n][:,e] - (dl_lo if lo else dl_hi))
                    for kk in range(4):
                        dsa = afromc(ds, kk)
                        for n in range(D//8):
                            acc[n] = mma(acc[n], dsa, loadB(kt, kTP, 8*n, 16*kk))
                for n in range(D//8):
                    c = 8*n + 2*TT
                    for l in range(32):
                        if r_lo[l] < T: dq[bh, r_lo[l], c[l]:c[l]+2] = acc[n][l,0:2]*scale
                        if r_hi[l] < T: dq[bh, r_hi[l], c[l]:c[l]+2] = acc[n][l,2:4]*scale
    return dq

def reference(q, k, v, dout, scale):
    BH, T, D = q.shape
    s = np.einsum('btd,bsd->bts', q, k)*scale
    mask = np.triu(np.ones((T,T), bool), 1)
    s[:, mask] = -np.inf
    m = s.max(-1, keepdims=True); e = np.exp(s - m); l = e.sum(-1, keepdims=True)
    p = e/l; out = p @ v; lse = (m + np.log(l))[..., 0]
    dv = np.einsum('bts,btd->bsd', p, dout)
    dp = dout @ v.transpose(0,2,1)
    ds = p*(dp - (dp*p).sum(-1, keepdims=True))
    dq = ds @ k * scale; dk = np.einsum('bts,btd->bsd', ds, q)*scale
    return out, lse, dq, dk, dv

rng = np.random.default_rng(0)
worst = 0.0
for (BH, T, D) in [(2, 70, 64), (1, 17, 64), (1, 130, 64), (1, 64, 128), (1, 33, 128)]:
    q = rng.uniform(-2, 2, (BH, T, D)); k = rng.uniform(-2, 2, (BH, T, D)); v = rng.uniform(-1, 1, (BH, T, D))
    dout = rng.uniform(-1, 1, (BH, T, D)); scale = 1/np.sqrt(D)
    ro, rl, rdq, rdk, rdv = reference(q, k, v, dout, scale)
    o, l = forward(q, k, v, scale)
    errs = dict(out=np.abs(o-ro).max(), lse=np.abs(l-rl).max())
    if D == 64:
        delta = (dout*o).sum(-1)
        dk_, dv_ = dkv(dout, q, k, v, l, delta, scale)
        dq_ = dq_k(dout, q, k, v, l, delta, scale)
        errs.update(dq=np.abs(dq_-rdq).max(), dk=np.abs(dk_-rdk).max(), dv=np.abs(dv_-rdv).max())
    print((BH, T, D), {kk: f"{vv:.1e}" for kk, vv in errs.items()}, flush=True)
    worst = max(worst, max(errs.values()))
print("ok" if worst < 1e-9 else "FAIL", f"(worst difference {worst:.1e})")
sys.exit(0 if worst < 1e-9 else 1)
