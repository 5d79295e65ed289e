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
from .kernel_src import INDEX_LIMIT, KernelArg, KernelSource, _HEADER
from .printer import TL_DTYPE

LOG2E = 1.4426950408889634


def _index(a, stride: int) -> str:
    return f"{a} * {stride}" if stride != 1 else str(a)


def generate_attention(group: FusionGroup, graph: LoopGraph) -> KernelSource:
    (name,) = group.nodes
    node = next(n for n in graph.nodes if n.name == name)
    if not isinstance(node, AttentionKernel):
        raise BuildError(f"internal: attention group {group.name} holds {type(node).__name__}")
    q, k, v = node.args
    b, h, t, d = (int(x) for x in q.shape)
    tk = int(k.shape[2])
    bm, bn = node.block_m, node.block_n
    for ta in (q, k, v):
        if graph.buffer(ta.buf).numel > INDEX_LIMIT:
            raise BuildError(f"attention {name}: {ta.buf} holds more than 2**31 elements",
                             remedy="split the batch; 64-bit indexing is not supported yet")
    ins: list[str] = []
    for ta in (q, k, v):
        if ta.buf not in ins:
            ins.append(ta.buf)
    args = [KernelArg(f"in_ptr{i}", bf, graph.buffer(bf).dtype, "in", int(graph.buffer(bf).numel))
            for i, bf in enumerate(ins)]
    args.append(KernelArg("out_ptr0", name, graph.buffer(name).dtype, "out", int(graph.buffer(name).numel)))
    ptr = {bf: f"in_ptr{i}" for i, bf in enumerate(ins)}
    dt = TL_DTYPE[graph.buffer(name).dtype]
    nm = -(-t // bm)
    bh = b * h

    def base(ta) -> str:
        sb, sh = int(ta.stride[0]), int(ta.stride[1])
        off = int(ta.offset)
        return f"{ptr[ta.buf]} + {off} + b * {sb} + h * {sh}" if off else f"{ptr[ta.buf]} + b * {sb} + h * {sh}"

    sqt, skt, svt = int(q.stride[2]), int(k.stride[2]), int(v.stride[2])
    L = [f"    pid = tl.program_id(0)",
         f"    pid_m = {nm - 1} - pid // {bh}  # the longest (causal) row blocks first",
         f"    bh = pid % {bh}",
         f"    b = bh // {h}",
         f"    h = bh % {h}",
         f"    rm = pid_m * {bm} + tl.arange(0, {bm})",
         f"    rd = tl.arange(0, {d})",
         f"    q_base = {base(q)}",
         f"    k_base = {base(k)}",
         f"    v_base = {base(v)}",
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
        if masked:
            keep = f"(rn[None, :] < {tk})" + (" & (rm[:, None] >= rn[None, :])" if node.causal else "")
            body.append(f"        qk = tl.where({keep}, qk, float('-inf'))")
        body += ["        m_new = tl.maximum(m_i, tl.max(qk, 1))",
                 "        p = tl.exp2(qk - m_new[:, None])",
                 "        alpha = tl.exp2(m_i - m_new)",
                 "        l_i = l_i * alpha + tl.sum(p, 1)",
                 "        acc = acc * alpha[:, None]",
                 f"        acc = tl.dot(p.to({TL_DTYPE[graph.buffer(v.buf).dtype]}), vt, acc)",
                 "        m_i = m_new"]
        return body

    stages = node.num_stages
    L.append(f"    for start in tl.range(0, lo, {bn}, num_stages={stages}):" if stages > 1 else
             f"    for start in range(0, lo, {bn}):")
    L += step(False)
    L.append(f"    for start in range(lo, hi, {bn}):")
    L += step(True)
    L += ["    out = acc / l_i[:, None]",
          f"    tl.store(out_ptr0 + b * {t * h * d} + h * {d} + {_index('rm[:, None]', h * d)} + rd[None, :], "
          f"out.to({dt}), rm[:, None] < {t})"]
    params = ", ".join(a.name for a in args)
    body = "\n".join(L)
    text = f"{_HEADER}\n@triton.jit\ndef KERNEL_NAME({params}):\n{body}\n"
    # xnumel: the query rows the grid covers (padded to BM per (batch, head)), rnumel: the head dim, so
    # the runtime's checks (grid = ceil(xnumel / XBLOCK), xnumel x rnumel within 32-bit indexing) hold
    kname = f"aotf_attn_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    why = (f"flash attention {bm}x{bn}, {node.num_warps} warps, {stages} stages"
           + (", causal" if node.causal else "") + f" ({b}x{h}x{t}x{d}, {tk} keys)")
    return KernelSource(kname, text.replace("KERNEL_NAME", kname), tuple(args), (nm * bh, 1, 1), node.num_warps,
                        group.name, "template_attn", group.nodes, bm, bn, nm * bh * bm, d, why=why,
                        num_stages=stages)
