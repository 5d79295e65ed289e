"""Host cost of the pieces one call of a program is made of (GPU): where the linked executor's time goes.

    python3 scripts/host_costs.py

Each line: median host microseconds of one operation (1000 repetitions, 5 rounds, the GPU drained
before each round so no full launch queue blocks a call): an extern called through its OpOverload
and through torch's Python binding, a prepared cublasLtMatmul (this tree), a strided view, an empty
allocation, a data_ptr read.
"""
from __future__ import annotations

import statistics
import time

import torch

aten = torch.ops.aten


def cost(fn, n=1000, rounds=5) -> float:
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return statistics.median(out) * 1e6


dev = "cuda"
a = torch.randn(128, 128, device=dev)
b = torch.randn(128, 384, device=dev)
o = torch.empty(128, 384, device=dev)
bias = torch.randn(384, device=dev)
q = torch.randn(2, 4, 64, 32, device=dev)
qh = q.bfloat16()
w = torch.randn(128, 128, device=dev)
ids = torch.randint(0, 128, (2, 64), device=dev)
eo = torch.empty(2, 64, 128, device=dev)
rows = [
    ("aten.mm.out (OpOverload)", lambda: aten.mm.out(a, b, out=o)),
    ("torch.mm(out=) (binding)", lambda: torch.mm(a, b, out=o)),
    ("aten.addmm.out (OpOverload)", lambda: aten.addmm.out(bias, a, b, out=o)),
    ("torch.addmm(out=) (binding)", lambda: torch.addmm(bias, a, b, out=o)),
    ("aten.embedding.out", lambda: aten.embedding.out(w, ids, out=eo)),
    ("torch.embedding", lambda: torch.embedding(w, ids)),
    ("aten.sdpa.default causal", lambda: aten.scaled_dot_product_attention.default(q, q, q, is_causal=True)),
    ("aten.sdpa.default causal bf16", lambda: aten.scaled_dot_product_attention.default(qh, qh, qh, is_causal=True)),
    ("F.sdpa causal", lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)),
    ("torch._scaled_dot_product_flash_attention", lambda: aten._scaled_dot_product_flash_attention(qh, qh, qh, 0.0, True)),
    ("as_strided", lambda: o.as_strided((128, 384), (384, 1), 0)),
    ("torch.empty 128x384", lambda: torch.empty((128, 384), dtype=torch.float32, device=dev)),
    ("data_ptr", lambda: o.data_ptr()),
    ("current_stream().cuda_stream", lambda: torch.cuda.current_stream(a.device).cuda_stream),
]
try:  # this tree's prepared cuBLASLt call (runtime/cublaslt.py) of the same mm / addmm
    from aotfuse.contract.program import TensorRef
    from aotfuse.runtime import cublaslt
    from aotfuse.runtime.executor import _View

    def _lt(target, tensors):
        views = [_View(i, TensorRef(f"b{i}", tuple(t.shape), tuple(t.stride()), 0)) for i, t in enumerate(tensors)]
        addr = [t.data_ptr() for t in tensors]
        spec = cublaslt.derive(target, views[:-1], {}, views[-1], {i: t.dtype for i, t in enumerate(tensors)})
        lib = cublaslt.library()
        plan = cublaslt.LtMatmul(lib, lib.take_handle(0), spec, cublaslt.Policy(*cublaslt.policy_key()),
                                 dict(enumerate(addr)), 32 << 20)
        ws = torch.empty(max(plan.workspace_needed, 1), dtype=torch.uint8, device=dev)
        plan.use_workspace(ws.data_ptr(), plan.workspace_needed)
        stream = torch.cuda.current_stream().cuda_stream
        return lambda: plan.run(stream, addr), ws

    lt_mm, _ws1 = _lt("aten.mm.out", [a, b, o])
    lt_addmm, _ws2 = _lt("aten.addmm.out", [bias, a, b, o])
    rows[2:2] = [("cublasLtMatmul mm (prepared)", lt_mm), ("cublasLtMatmul addmm+bias (prepared)", lt_addmm),
                 ("policy_key (per call check)", cublaslt.policy_key)]
except ImportError:  # an older tree
    pass
print(torch.cuda.get_device_name(), torch.__version__)
for name, fn in rows:
    for _ in range(50):
        fn()
    print(f"{name:45s} {cost(fn):7.2f} us")
