"""Probe: the MLP's dgrad matmul with the tanh-GELU backward (and the bias gradient's column sums) in its
epilogue, against cuBLAS and separate kernels (the anchor GPT's training step, issue 11.4).

    python3 scripts/dgelu_probe.py [--rows 8192] [--d 768] [--hidden 3072] [--mode bwd,fwd]

The training step's backward of `fc2(gelu(fc1(x)))` computes, per layer:
    dg = dY @ W2                       (cuBLAS: 8192 x 768 @ 768 x 3072, dg written in bf16)
    g = gelu(h); dh = dg * gelu'(h)    (one pointwise kernel: reads dg and the saved pre-activation h,
                                        writes g for fc2's weight gradient and dh)
    db1 = dh.sum(0)                    (column partial sums: reads dh again)
Fused, one persistent TMA template computes dg tile by tile and applies the epilogue to its fp32
accumulator: dg is never written, dh's column sums come from the tile in registers (one partial row per
row tile, summed by a tiny kernel). This prints, by CUDA-graph replay (medians, us), the unfused path
against the fused kernel over a few tile configurations and epilogue sub-tilings, and checks results.
Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import torch
import triton
import triton.language as tl
from ce_prologue_probe import graph_us  # scripts/ is sys.path[0] when this script runs

K0 = 0.7978845608028654  # sqrt(2 / pi)
K1 = 0.044715


@triton.jit
def _tanh_fast(x):
    return 1.0 - tl.fdiv(2.0, 1.0 + tl.exp2(x * 2.8853900817779268), ieee_rounding=False)


@triton.jit
def _gelu_both(dg, h):
    """(g, dh) of the tanh GELU at h with incoming gradient dg, fp32."""
    inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    t = _tanh_fast(inner)
    g = 0.5 * h * (1.0 + t)
    d = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * h * h)
    return g, dg * d


@triton.jit
def pw_kernel(dg_ptr, h_ptr, g_ptr, dh_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dg = tl.load(dg_ptr + offs).to(tl.float32)
    h = tl.load(h_ptr + offs).to(tl.float32)
    g, dh = _gelu_both(dg, h)
    tl.store(g_ptr + offs, g.to(tl.bfloat16))
    tl.store(dh_ptr + offs, dh.to(tl.bfloat16))


@triton.jit
def colsum_part(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, RB: tl.constexpr, XB: tl.constexpr,
                PARTS: tl.constexpr):
    """out[p, n] = sum of rows p*M/PARTS .. of x[:, n]."""
    pn = tl.program_id(0)
    p = tl.program_id(1)
    rn = pn * XB + tl.arange(0, XB)
    acc = tl.zeros([RB, XB], dtype=tl.float32)
    for r0 in range(p * (M // PARTS), (p + 1) * (M // PARTS), RB):
        rr = r0 + tl.arange(0, RB)
        acc += tl.load(x_ptr + rr[:, None] * N + rn[None, :]).to(tl.float32)
    tl.store(out_ptr + p * N + rn, tl.sum(acc, 0))


@triton.jit
def colsum_final(part_ptr, out_ptr, N: tl.constexpr, P: tl.constexpr, XB: tl.constexpr):
    rn = tl.program_id(0) * XB + tl.arange(0, XB)
    rp = tl.arange(0, P)
    v = tl.load(part_ptr + rp[:, None] * N + rn[None, :])
    tl.store(out_ptr + rn, tl.sum(v, 0).to(tl.bfloat16))


@triton.jit
def _tile_of(tile, tm, tn, GM: tl.constexpr):
    """(row tile, column tile) of a persistent loop's `tile`, GM rows of tiles at a time (L2 reuse)."""
    first_m = tile // (GM * tn) * GM
    group_size = tl.minimum(tm - first_m, GM)
    return first_m + (tile % (GM * tn)) % group_size, (tile % (GM * tn)) // group_size


@triton.jit
def _chunk(part, rm, c0, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0,
           N: tl.constexpr, W: tl.constexpr, COLSUM: tl.constexpr, TMA_H: tl.constexpr, TMA_ST: tl.constexpr):
    """The epilogue of columns c0 .. c0 + W of a tile (part: the fp32 accumulator's columns)."""
    rn = c0 + tl.arange(0, W)
    off = rm[:, None] * N + rn[None, :]
    if TMA_H:
        h = h_desc.load([row0, c0]).to(tl.float32)
    else:
        h = tl.load(h_ptr + off).to(tl.float32)
    g, dh = _gelu_both(part, h)
    dhb = dh.to(tl.bfloat16)
    if TMA_ST:
        g_desc.store([row0, c0], g.to(tl.bfloat16))
        dh_desc.store([row0, c0], dhb)
    else:
        tl.store(g_ptr + off, g.to(tl.bfloat16))
        tl.store(dh_ptr + off, dhb)
    if COLSUM:
        tl.store(part_ptr + pid_m * N + rn, tl.sum(dhb.to(tl.float32), 0))


@triton.jit
def fused_kernel(a_ptr, b_ptr, h_ptr, g_ptr, dh_ptr, part_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, WS: tl.constexpr,
                 SUB: tl.constexpr, COLSUM: tl.constexpr, STAGES: tl.constexpr, TMA_H: tl.constexpr,
                 TMA_ST: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    W: tl.constexpr = BN // SUB
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, W])
    g_desc = tl.make_tensor_descriptor(g_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, W])
    dh_desc = tl.make_tensor_descriptor(dh_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, W])
    tm: tl.constexpr = M // BM
    tn: tl.constexpr = N // BN
    for tile in tl.range(tl.program_id(0), tm * tn, tl.num_programs(0), flatten=not WS, warp_specialize=WS,
                         num_stages=STAGES):
        pid_m, pid_n = _tile_of(tile, tm, tn, GM)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([k0, pid_n * BN])
            acc = tl.dot(a, b, acc)
        rm = pid_m * BM + tl.arange(0, BM)
        row0 = pid_m * BM
        c0 = pid_n * BN
        if SUB == 1:
            _chunk(acc, rm, c0, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W, COLSUM,
                   TMA_H, TMA_ST)
        elif SUB == 2:
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            _chunk(a0, rm, c0, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W, COLSUM,
                   TMA_H, TMA_ST)
            _chunk(a1, rm, c0 + W, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W,
                   COLSUM, TMA_H, TMA_ST)
        else:
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            a00, a01 = tl.split(tl.reshape(a0, (BM, 2, BN // 4)).permute(0, 2, 1))
            a10, a11 = tl.split(tl.reshape(a1, (BM, 2, BN // 4)).permute(0, 2, 1))
            _chunk(a00, rm, c0, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W, COLSUM,
                   TMA_H, TMA_ST)
            _chunk(a01, rm, c0 + W, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W,
                   COLSUM, TMA_H, TMA_ST)
            _chunk(a10, rm, c0 + 2 * W, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W,
                   COLSUM, TMA_H, TMA_ST)
            _chunk(a11, rm, c0 + 3 * W, h_ptr, g_ptr, dh_ptr, part_ptr, h_desc, g_desc, dh_desc, pid_m, row0, N, W,
                   COLSUM, TMA_H, TMA_ST)


@triton.jit
def gelu_kernel(h_ptr, g_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(h_ptr + offs).to(tl.float32)
    g = 0.5 * h * (1.0 + _tanh_fast(0.7978845608028654 * (h + 0.044715 * h * h * h)))
    tl.store(g_ptr + offs, g.to(tl.bfloat16))


@triton.jit
def _fwd_chunk(part, rm, c0, bias_ptr, h_ptr, g_ptr, N: tl.constexpr, W: tl.constexpr):
    rn = c0 + tl.arange(0, W)
    off = rm[:, None] * N + rn[None, :]
    hb = (part + tl.load(bias_ptr + rn)[None, :].to(tl.float32)).to(tl.bfloat16)
    tl.store(h_ptr + off, hb)
    h = hb.to(tl.float32)
    g = 0.5 * h * (1.0 + _tanh_fast(0.7978845608028654 * (h + 0.044715 * h * h * h)))
    tl.store(g_ptr + off, g.to(tl.bfloat16))


@triton.jit
def fwd_kernel(a_ptr, w_ptr, bias_ptr, h_ptr, g_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, WS: tl.constexpr,
               SUB: tl.constexpr, STAGES: tl.constexpr):
    """h = x @ W1^T + b (stored: the backward's saved pre-activation) and g = gelu(h) (fc2's input)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    W: tl.constexpr = BN // SUB
    tm: tl.constexpr = M // BM
    tn: tl.constexpr = N // BN
    for tile in tl.range(tl.program_id(0), tm * tn, tl.num_programs(0), flatten=not WS, warp_specialize=WS,
                         num_stages=STAGES):
        pid_m, pid_n = _tile_of(tile, tm, tn, GM)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([pid_n * BN, k0]).T
            acc = tl.dot(a, b, acc)
        rm = pid_m * BM + tl.arange(0, BM)
        c0 = pid_n * BN
        if SUB == 1:
            _fwd_chunk(acc, rm, c0, bias_ptr, h_ptr, g_ptr, N, W)
        else:
            a0, a1 = tl.split(tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1))
            _fwd_chunk(a0, rm, c0, bias_ptr, h_ptr, g_ptr, N, W)
            _fwd_chunk(a1, rm, c0 + W, bias_ptr, h_ptr, g_ptr, N, W)


FWD_CONFIGS = [  # (BM, BN, BK, GM, WARPS, STAGES, WS, SUB, PROGRAMS PER SM)
    (128, 256, 64, 8, 8, 3, False, 1, 1), (128, 256, 64, 8, 8, 3, False, 2, 1), (128, 128, 64, 8, 8, 4, False, 2, 1),
    (128, 128, 64, 8, 8, 3, False, 1, 2), (128, 128, 64, 8, 8, 3, False, 2, 2), (128, 128, 64, 8, 4, 3, False, 1, 2),
    (128, 128, 64, 8, 4, 3, False, 2, 2),
]


def forward_probe(M: int, K: int, N: int, sms: int) -> None:
    bf = torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=bf)
    w1 = torch.randn(N, K, device="cuda", dtype=bf) / K ** 0.5
    b1 = torch.randn(N, device="cuda", dtype=bf)
    h_ref = torch.addmm(b1, x, w1.t())
    g_ref = torch.nn.functional.gelu(h_ref.float(), approximate="tanh")
    h = torch.empty(M, N, device="cuda", dtype=bf)
    g = torch.empty(M, N, device="cuda", dtype=bf)

    def unfused():
        torch.addmm(b1, x, w1.t(), out=h)
        gelu_kernel[(M * N // 1024,)](h, g, 1024, num_warps=4)

    rows = [("cuBLAS addmm", graph_us(lambda: torch.addmm(b1, x, w1.t(), out=h))),
            ("cuBLASLt GELU (inference: no h)", graph_us(lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True))),
            ("unfused total (addmm, gelu kernel)", graph_us(unfused))]
    base = rows[-1][1]
    for cfg in FWD_CONFIGS:
        bm, bn, bk, gm, warps, stages, ws, sub, progs = cfg
        grid = (min(progs * sms, (M // bm) * (N // bn)),)

        def fused(cfg=cfg, grid=grid):
            bm, bn, bk, gm, warps, stages, ws, sub, progs = cfg
            return fwd_kernel[grid](x, w1, b1, h, g, M, N, K, bm, bn, bk, gm, ws, sub, stages, num_warps=warps,
                                    num_stages=stages)

        name = f"fused {bm}x{bn}x{bk} w{warps} s{stages}{' ws' if ws else ''} sub{sub}" + \
            (f" x{progs}/SM" if progs > 1 else "")
        try:
            h.zero_()
            g.zero_()
            ck = fused()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        e_h = float((h.float() - h_ref.float()).norm() / h_ref.float().norm())
        e_g = float((g.float() - g_ref).norm() / g_ref.norm())
        if max(e_h, e_g) > 2e-2:
            print(f"  {name}: WRONG h {e_h:.1e} g {e_g:.1e}", flush=True)
            continue
        rows.append((name + f" ({getattr(ck, 'n_regs', '?')} regs, {getattr(ck.metadata, 'shared', 0) // 1024} KiB)",
                     graph_us(fused)))
    print(f"\n| {M} x {N} x {K}: h = x @ W1^T + b and g = gelu(h), both stored | us | vs unfused |")
    print("|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {us / base:.2f} |")


# (BM, BN, BK, GM, WARPS, STAGES, WS, SUB, COLSUM, TMA_H, TMA_ST, PROGRAMS PER SM)
CONFIGS = [
    (128, 256, 64, 8, 8, 3, False, 2, True, False, False, 1), (128, 256, 64, 8, 8, 3, False, 4, True, False, False, 1),
    (128, 256, 64, 8, 8, 3, False, 2, True, False, True, 1), (128, 128, 64, 8, 8, 4, False, 2, True, False, False, 1),
    (256, 128, 64, 8, 8, 3, False, 2, True, False, True, 1),
    (128, 256, 64, 8, 8, 3, False, 2, False, False, False, 1),
    # two programs per SM: one's epilogue runs while the other's tensor cores work
    (128, 128, 64, 8, 8, 3, False, 1, True, False, False, 2), (128, 128, 64, 8, 8, 3, False, 2, True, False, False, 2),
    (128, 128, 64, 8, 4, 3, False, 1, True, False, False, 2), (128, 128, 64, 8, 4, 3, False, 2, True, False, False, 2),
    (128, 128, 64, 8, 8, 2, False, 2, True, False, False, 2), (64, 256, 64, 8, 4, 3, False, 2, True, False, False, 2),
    (128, 128, 64, 8, 4, 2, False, 2, True, False, False, 3), (128, 128, 64, 8, 8, 3, False, 2, False, False, False, 2),
    (128, 128, 64, 8, 4, 3, False, 2, False, False, False, 2), (128, 128, 64, 8, 4, 3, False, 4, False, False, False, 2),
]
# Warp-specialized kernels with this epilogue (H100, 2026-11-27): 128x256x64 4 warps 1929 us, 128x128x64 318 us;
# with the column sums in the epilogue Triton 3.6's Hopper pass fails ("reduce should not happen on the
# partitioned dimension"). Not tried again.


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--mode", default="bwd,fwd", help="bwd: the dgrad with the GELU backward; fwd: fc1 with the "
                    "bias and GELU, storing both the pre-activation and the activation (the training forward)")
    args = ap.parse_args()
    M, K, N = args.rows, args.d, args.hidden
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if "fwd" in args.mode:
        forward_probe(M, K, N, sms)
    if "bwd" not in args.mode:
        return
    bf = torch.bfloat16
    dy = torch.randn(M, K, device="cuda", dtype=bf)
    w2 = (torch.randn(K, N, device="cuda", dtype=bf) / K ** 0.5)  # fc2.weight: [out=d, in=hidden]
    h = torch.randn(M, N, device="cuda", dtype=bf)
    # reference (fp32 from the bf16 inputs)
    dg_ref = dy.float() @ w2.float()
    hf = h.float()
    t = torch.tanh(K0 * (hf + K1 * hf ** 3))
    g_ref = 0.5 * hf * (1 + t)
    dh_ref = dg_ref * (0.5 * (1 + t) + 0.5 * hf * (1 - t * t) * K0 * (1 + 3 * K1 * hf * hf))
    db_ref = dh_ref.sum(0)

    dg = torch.empty(M, N, device="cuda", dtype=bf)
    g = torch.empty(M, N, device="cuda", dtype=bf)
    dh = torch.empty(M, N, device="cuda", dtype=bf)
    parts = 32
    part = torch.empty(parts, N, device="cuda", dtype=torch.float32)
    db = torch.empty(N, device="cuda", dtype=bf)

    def unfused():
        torch.mm(dy, w2, out=dg)
        pw_kernel[(M * N // 1024,)](dg, h, g, dh, 1024, num_warps=4)
        colsum_part[(N // 64, parts)](dh, part, M, N, 64, 64, parts, num_warps=8)
        colsum_final[(N // 64,)](part, db, N, parts, 64, num_warps=1)

    def mm_only():
        torch.mm(dy, w2, out=dg)

    def pw_only():
        pw_kernel[(M * N // 1024,)](dg, h, g, dh, 1024, num_warps=4)

    def colsum_only():
        colsum_part[(N // 64, parts)](dh, part, M, N, 64, 64, parts, num_warps=8)
        colsum_final[(N // 64,)](part, db, N, parts, 64, num_warps=1)

    def check(tag):
        torch.cuda.synchronize()
        e_g = float((g.float() - g_ref).norm() / g_ref.norm())
        e_dh = float((dh.float() - dh_ref).norm() / dh_ref.norm())
        e_db = float((db.float() - db_ref).norm() / db_ref.norm())
        ok = max(e_g, e_dh, e_db) < 2e-2
        print(f"  {tag}: rel err g {e_g:.1e} dh {e_dh:.1e} db {e_db:.1e} {'ok' if ok else 'WRONG'}", flush=True)
        return ok

    unfused()
    check("unfused")
    rows = [("cuBLAS mm", graph_us(mm_only)), ("pointwise (g, dh)", graph_us(pw_only)),
            ("column sums of dh", graph_us(colsum_only)), ("unfused total", graph_us(unfused))]
    base = rows[-1][1]
    for cfg in CONFIGS:
        bm, bn, bk, gm, warps, stages, ws, sub, colsum, tmah, tmast, progs = cfg
        tm = M // bm
        fpart = torch.empty(tm, N, device="cuda", dtype=torch.float32)
        grid = (min(progs * sms, tm * (N // bn)),)

        def fused(cfg=cfg, fpart=fpart, grid=grid, tm=tm):
            bm, bn, bk, gm, warps, stages, ws, sub, colsum, tmah, tmast, progs = cfg
            ck = fused_kernel[grid](dy, w2, h, g, dh, fpart, M, N, K, bm, bn, bk, gm, ws, sub, colsum, stages, tmah,
                                    tmast, num_warps=warps, num_stages=stages)
            if colsum:
                colsum_final[(N // 64,)](fpart, db, N, tm, 64, num_warps=4)
            else:
                colsum_only()
            return ck

        name = (f"fused {bm}x{bn}x{bk} g{gm} w{warps} s{stages}{' ws' if ws else ''} sub{sub}"
                f"{'' if colsum else ' +colsum kernel'}{' tmaH' if tmah else ''}{' tmaSt' if tmast else ''}"
                f"{f' x{progs}/SM' if progs > 1 else ''}")
        try:
            g.zero_()
            dh.zero_()
            db.zero_()
            ck = fused()
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        if not check(name):
            continue
        res = f" ({getattr(ck, 'n_regs', '?')} regs, {getattr(ck.metadata, 'shared', 0) // 1024} KiB)"
        rows.append((name + res, graph_us(fused)))
    print(f"\n| {M} x {N} x {K}: dg = dY @ W2, g and dh = gelu'(h) dg, db = dh.sum(0) | us | vs unfused |")
    print("|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {us / base:.2f} |")


if __name__ == "__main__":
    main()
