"""An attention group (one AttentionKernel) -> a Triton flash-attention forward kernel's source.

One program per BLOCK_M query rows of one (batch, head), the longest causal rows first (program 0
takes the last row block, so the heaviest programs start earliest); a 1-D grid of ceil(T/BM) x B x H.
Per program: Q's tile loaded once; a loop over the keys in BLOCK_N steps with the online softmax in
base 2 (m, l running in fp32, the scale folded into log2(e)); P cast to the value dtype for the
second tl.dot; the result divided by l once and stored [B, T, H, D]. A causal kernel runs the key
blocks left of the diagonal unmasked and only the diagonal's under the mask. Sizes, strides and the
views' offsets are literals (static shapes): q, k and v may be strided views of one buffer (the
qkv projection's output), read in place.
"""
from __future__ import annotations

import hashlib

from ..errors import BuildError
from ..ir.attention import AttentionKernel
from ..ir.loop import LoopGraph
from ..schedule.fusion import FusionGroup
from ..schedule.attention import index_refusal
from .kernel_src import KernelArg, KernelSource, loop_range
from .pdl import kernel_text
from .printer import TL_DTYPE, header

LOG2E = 1.4426950408889634


def _index(a, stride: int) -> str:
    return f"{a} * {stride}" if stride != 1 else str(a)


def generate_attention(group: FusionGroup, graph: LoopGraph) -> KernelSource:
    (name,) = group.nodes
    node = next(n for n in graph.nodes if n.name == name)
    if not isinstance(node, AttentionKernel):
        raise BuildError(f"internal: attention group {group.name} holds {type(node).__name__}")
    q, k, v = node.args[:3]
    mask = node.args[3] if node.mask else None
    b, h, t, d = (int(x) for x in q.shape)
    tk = int(k.shape[2])
    bm, bn = node.block_m, node.block_n
    operands = (q, k, v) if mask is None else (q, k, v, mask)
    why = index_refusal(operands, node.block_m)
    if why is not None:  # schedule/attention.refusal keeps such an attention on sdpa: this is a bug if reached
        raise BuildError(f"internal: attention {name}: {why}")
    ins: list[str] = []
    for ta in operands:
        if ta.buf not in ins:
            ins.append(ta.buf)
    args = [KernelArg(f"in_ptr{i}", bf, graph.buffer(bf).dtype, "in", int(graph.buffer(bf).numel))
            for i, bf in enumerate(ins)]
    args.append(KernelArg("out_ptr0", name, graph.buffer(name).dtype, "out", int(graph.buffer(name).numel)))
    ptr = {bf: f"in_ptr{i}" for i, bf in enumerate(ins)}
    dt = TL_DTYPE[graph.buffer(name).dtype]
    nm = -(-t // bm)
    bh = b * h

    per_kv = h // int(k.shape[1])  # query heads per k/v head (grouped-query attention; 1 otherwise)

    def base(ta, sb: int, sh: int, head: str = "h") -> str:
        off = int(ta.offset)
        return f"{ptr[ta.buf]}{f' + {off}' if off else ''} + b * {sb} + {head} * {sh}"

    def qkv_base(ta, head: str = "h") -> str:
        return base(ta, int(ta.stride[0]), int(ta.stride[1]), head)

    sqt, skt, svt = int(q.stride[2]), int(k.stride[2]), int(v.stride[2])
    if mask is not None:  # right-aligned to [B, H, T, S]; a broadcast dim (size 1) has stride 0
        r = len(mask.shape)
        mshape = (1,) * (4 - r) + tuple(int(x) for x in mask.shape)
        mstride = (0,) * (4 - r) + tuple(int(x) for x in mask.stride)
        msb, msh, msq, msk = (0 if n_ == 1 else st_ for n_, st_ in zip(mshape, mstride))
    L = [f"    pid = tl.program_id(0)",
         f"    pid_m = {nm - 1} - pid // {bh}  # the longest (causal) row blocks first",
         f"    bh = pid % {bh}",
         f"    b = bh // {h}",
         f"    h = bh % {h}",
         f"    rm = pid_m * {bm} + tl.arange(0, {bm})",
         f"    rd = tl.arange(0, {d})",
         f"    q_base = {qkv_base(q)}",
         *([f"    hk = h // {per_kv}  # grouped-query attention: the k/v head of this query head"] if per_kv > 1 else []),
         f"    k_base = {qkv_base(k, 'hk' if per_kv > 1 else 'h')}",
         f"    v_base = {qkv_base(v, 'hk' if per_kv > 1 else 'h')}",
         *([f"    m_base = {base(mask, msb, msh)}"] if mask is not None else []),
         f"    q = tl.load(q_base + {_index('rm[:, None]', sqt)} + rd[None, :], rm[:, None] < {t}, other=0)",
         f"    m_i = tl.full([{bm}], float('-inf'), tl.float32)",
         f"    l_i = tl.full([{bm}], 1.0, tl.float32)",
         f"    acc = tl.zeros([{bm}, {d}], dtype=tl.float32)"]
    if node.causal:  # key blocks wholly left of the diagonal need no mask
        L += [f"    lo = pid_m * {bm} // {bn} * {bn}", f"    hi = tl.minimum((pid_m + 1) * {bm}, {tk})"]
    else:
        L += [f"    lo = {tk // bn * bn}", f"    hi = {tk}"]
    qk_scale = node.scale * LOG2E

    def step(masked: bool) -> list[str]:
        kmask = f", rn[:, None] < {tk}, other=0" if masked else ""
        body = [f"        rn = start + tl.arange(0, {bn})",
                f"        kt = tl.load(k_base + {_index('rn[:, None]', skt)} + rd[None, :]{kmask})",
                f"        vt = tl.load(v_base + {_index('rn[:, None]', svt)} + rd[None, :]{kmask})",
                f"        qk = tl.dot(q, kt.T) * {qk_scale!r}"]
        if mask is not None:  # sdpa's attn_mask: bool keeps where True, a float one adds to the scores
            if msq == 0:  # the same for every query row (a padding mask): one row of it per key block
                bound = f", rn < {tk}, other=0" if masked else ""
                mload = f"tl.load(m_base + {_index('rn', msk)}{bound})[None, :]"
            else:
                mload = (f"tl.load(m_base + {_index('rm[:, None]', msq)} + {_index('rn[None, :]', msk)}, "
                         f"(rm[:, None] < {t}) & (rn[None, :] < {tk}), other=0)")
            body.append(f"        mk = {mload}")
            if node.mask == "bool":
                body.append("        qk = tl.where(mk != 0, qk, float('-inf'))")
            else:
                # in base 2 like the scores; a finite mask value is clamped first so that finfo.min (HF's
                # padding value) times log2(e) stays finite: a row masked everywhere with it is then uniform, as
                # in eager, where only -inf rows give 0
                body += ["        mf = mk.to(tl.float32)",
                         f"        qk = qk + tl.where(mf == float('-inf'), mf, tl.maximum(mf, -2.0e38) * {LOG2E!r})"]
        if masked:
            keep = f"(rn[None, :] < {tk})" + (" & (rm[:, None] >= rn[None, :])" if node.causal else "")
            body.append(f"        qk = tl.where({keep}, qk, float('-inf'))")
        body.append("        m_new = tl.maximum(m_i, tl.max(qk, 1))")
        if mask is not None:  # a row masked so far everywhere: exponents against 0, not -inf - -inf
            body += ["        m_use = tl.where(m_new == float('-inf'), 0.0, m_new)",
                     "        p = tl.exp2(qk - m_use[:, None])",
                     "        alpha = tl.exp2(m_i - m_use)"]
        else:
            body += ["        p = tl.exp2(qk - m_new[:, None])",
                     "        alpha = tl.exp2(m_i - m_new)"]
        body += ["        l_i = l_i * alpha + tl.sum(p, 1)",
                 "        acc = acc * alpha[:, None]",
                 f"        acc = tl.dot(p.to({TL_DTYPE[graph.buffer(v.buf).dtype]}), vt, acc)",
                 "        m_i = m_new"]
        return body

    stages = node.num_stages
    L.append(f"    for start in {loop_range(0, 'lo', bn, stages)}:")
    L += step(False)
    L.append(f"    for start in range(lo, hi, {bn}):")
    L += step(True)
    # a row the mask hides everywhere sums to 0: it gives 0, as torch's math sdpa does
    L += ["    out = acc / " + ("tl.where(l_i == 0, 1.0, l_i)[:, None]" if mask is not None else "l_i[:, None]"),
          f"    tl.store(out_ptr0 + b * {t * h * d} + h * {d} + {_index('rm[:, None]', h * d)} + rd[None, :], "
          f"out.to({dt}), rm[:, None] < {t})"]
    params = ", ".join(a.name for a in args)
    body = "\n".join(L)
    text = kernel_text(header(body), params, body)
    # xnumel: the query rows the grid covers (padded to BM per (batch, head)), rnumel: the head dim, so
    # the runtime's checks (grid = ceil(xnumel / XBLOCK), xnumel x rnumel within 32-bit indexing) hold
    kname = f"aotf_attn_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    why = (f"flash attention {bm}x{bn}, {node.num_warps} warps, {stages} stages"
           + (", causal" if node.causal else "") + (f", {node.mask} mask" if node.mask else "")
           + f" ({b}x{h}x{t}x{d}, {tk} keys)")
    return KernelSource(kname, text.replace("KERNEL_NAME", kname), tuple(args), (nm * bh, 1, 1), node.num_warps,
                        group.name, "template_attn", group.nodes, bm, bn, nm * bh * bm, d, why=why,
                        num_stages=stages)
