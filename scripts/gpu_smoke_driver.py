#!/usr/bin/env python3
"""GPU smoke test of aotfuse.runtime.cuda_driver: triton-built cubins, launched without triton.

    PYTHONPATH=$PWD python3 scripts/gpu_smoke_driver.py [--keep DIR]

1. This process compiles a few kernels with ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
   arch, 32))`` for sm_90 and for the device's own arch (exactly what the CPU build machine does) and
   writes each cubin + its KernelSpec JSON to a directory.
2. A fresh ``python -X importtime`` subprocess loads and launches them through cuda_driver only, checks
   the results against torch (eager, plain stream, side stream, CUDA graph replay, >48 KiB shared
   memory, a global-scratch kernel) and verifies that triton / torch._dynamo / torch._inductor were
   never imported (sys.modules and the importtime log).
3. Prints a pass/fail table; exit status 0 only if nothing failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = ("triton", "torch._dynamo", "torch._inductor")


def _forbidden(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


# ---------------------------------------------------------------------------------------- build side


def build(out: Path, archs: list[int]) -> list[dict]:
    """Compile every kernel for every arch into ``out``; returns rows for failures."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aotfuse.runtime.kernel_spec import KernelSpec

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

    @triton.jit
    def rowsum_kernel(x_ptr, out_ptr, ncols, scale, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * row_stride + cols, mask=cols < ncols, other=0.0)
        tl.store(out_ptr + row, tl.sum(v, axis=0) * scale)

    @triton.jit
    def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            kk = k + rk
            a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + kk[:, None] * N + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def tma_scale_kernel(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        # device-side TMA descriptors live in the global scratch buffer on sm_90
        din = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        dout = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        dout.store([pm * BM, pn * BN], din.load([pm * BM, pn * BN]) * 2.0)

    kernels = {
        "add": (add_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                             "BLOCK": "constexpr"}, {"BLOCK": 1024}, {}),
        "rowsum": (rowsum_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "ncols": "i32", "scale": "fp32",
                                   "row_stride": "i64", "BLOCK": "constexpr"}, {"BLOCK": 1024}, {}),
        "matmul": (matmul_kernel, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "M": "i32", "N": "i32",
                                   "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
                   {"BM": 128, "BN": 128, "BK": 64}, {"num_warps": 8, "num_stages": 3}),
        "tma_scale": (tma_scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32",
                                         "BM": "constexpr", "BN": "constexpr"}, {"BM": 32, "BN": 64}, {}),
    }
    rows = []
    for arch in archs:
        for kname, (fn, sig, consts, opts) in kernels.items():
            t0 = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                                          options=opts or None)
                spec = KernelSpec.from_compiled(compiled)
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows.append(dict(arch=arch, check=f"compile {kname}", ok=False, detail=f"{type(e).__name__}: {e}"))
                continue
            stem = out / f"sm{arch}_{kname}"
            stem.with_suffix(".cubin").write_bytes(spec.cubin)
            stem.with_suffix(".json").write_text(json.dumps(dict(spec.to_json(), kernel=kname)))
            rows.append(dict(arch=arch, check=f"compile {kname}", ok=True,
                             detail=f"{time.perf_counter() - t0:.1f}s {spec.name} warps={spec.num_warps} "
                                    f"shared={spec.shared} gscratch={spec.global_scratch_size}/"
                                    f"{spec.global_scratch_align} params={list(spec.arg_types)}+2 scratch"))
    return rows


# ---------------------------------------------------------------------------------------- run side


def run_child(d: Path) -> list[dict]:
    """Load + launch every cubin in ``d`` without triton; returns result rows."""
    import torch

    from aotfuse.runtime import cuda_driver as cd
    from aotfuse.runtime import kernel_spec

    rows: list[dict] = []

    def row(arch, check, ok, detail=""):
        rows.append(dict(arch=arch, check=check, ok=bool(ok), detail=detail))

    dev = torch.cuda.current_device()
    my_arch = cd.device_arch(dev)
    torch.manual_seed(0)
    specs: dict[int, dict[str, kernel_spec.KernelSpec]] = {}
    for js in sorted(d.glob("*.json")):
        meta = json.loads(js.read_text())
        kname = meta.pop("kernel")
        specs.setdefault(meta["arch"], {})[kname] = kernel_spec.KernelSpec.from_json(meta, js.with_suffix(".cubin").read_bytes())

    def maxerr(a, b) -> str:
        return f"max|err|={(a.float() - b.float()).abs().max().item():.2e}"

    for arch, ks in sorted(specs.items()):
        if arch != my_arch:
            # sm_90a cubins are arch-specific: expected to load only on sm_90.
            try:
                cd.CudaModule.load(ks["add"].cubin).close()
                row(arch, "load on foreign arch", True, f"loaded on sm_{my_arch}")
            except cd.AotfuseError as e:
                row(arch, "load on foreign arch", True, f"expected refusal on sm_{my_arch}: {e}"[:150])
            continue
        stream = torch.cuda.current_stream().cuda_stream

        def check(name, fn):
            try:
                ok, detail = fn()
            except Exception as e:  # noqa: BLE001
                ok, detail = False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            row(arch, name, ok, detail)

        loaded = {k: s.load() for k, s in ks.items()}

        def t_add():
            s = ks["add"]
            _, f = loaded["add"]
            n = 1000003
            x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            out = torch.full_like(x, float("nan"))
            f.launch(((n + 1023) // 1024, 1, 1), s.num_warps, s.shared, stream,
                     [x.data_ptr(), y.data_ptr(), out.data_ptr(), n], s.arg_types)
            torch.cuda.synchronize()
            return torch.equal(out, x + y), f"n={n} (masked tail) {maxerr(out, x + y)}"

        def t_side_stream():
            s = ks["add"]
            _, f = loaded["add"]
            n = 4097
            x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            out = torch.empty_like(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f.launch(((n + 1023) // 1024, 1, 1), s.num_warps, s.shared, side.cuda_stream,
                         [x.data_ptr(), y.data_ptr(), out.data_ptr(), n], s.arg_types)
            side.synchronize()
            return torch.equal(out, x + y), f"stream=0x{side.cuda_stream:x}"

        def t_rowsum():
            s = ks["rowsum"]
            _, f = loaded["rowsum"]
            rows_, cols = 37, 1000
            x = torch.randn(rows_, 1024 + 17, device="cuda")[:, :cols]
            out = torch.empty(rows_, device="cuda")
            f.launch((rows_, 1, 1), s.num_warps, s.shared, stream,
                     [x.data_ptr(), out.data_ptr(), cols, 0.5, x.stride(0)], s.arg_types)
            ref = x.sum(1) * 0.5
            return torch.allclose(out, ref, rtol=1e-4, atol=1e-4), f"37x1000 strided, fp32+i64 args {maxerr(out, ref)}"

        def t_matmul():
            s = ks["matmul"]
            _, f = loaded["matmul"]
            M, N, K = 300, 260, 200
            a = torch.randn(M, K, device="cuda", dtype=torch.float16)
            b = torch.randn(K, N, device="cuda", dtype=torch.float16)
            c = torch.empty(M, N, device="cuda")
            f.launch(((M + 127) // 128, (N + 127) // 128, 1), s.num_warps, s.shared, stream,
                     [a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K], s.arg_types)
            ref = a.float() @ b.float()
            return (torch.allclose(c, ref, rtol=1e-2, atol=5e-2),
                    f"shared={s.shared}B (>48KiB opt-in), 2-D grid {maxerr(c, ref)}")

        def t_tma_scratch():
            s = ks["tma_scale"]
            _, f = loaded["tma_scale"]
            M, N = 100, 192
            grid = ((M + 31) // 32, (N + 63) // 64, 1)
            x = torch.randn(M, N, device="cuda")
            out = torch.zeros_like(x)
            gbytes, pbytes = kernel_spec.scratch_bytes(s, grid)
            gbuf = torch.empty(max(gbytes, 1), dtype=torch.uint8, device="cuda")
            f.launch(grid, s.num_warps, s.shared, stream, [x.data_ptr(), out.data_ptr(), M, N], s.arg_types,
                     global_scratch=gbuf.data_ptr() if gbytes else 0)
            ok = torch.equal(out, x * 2)
            return ok, f"global scratch {gbytes}B ({s.global_scratch_size}B x {grid[0] * grid[1]} programs)"

        def t_graph():
            s = ks["add"]
            _, f = loaded["add"]
            n = 65537
            x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            out = torch.empty_like(x)
            run = f.bind(s.arg_types, s.num_warps, s.shared)
            grid = ((n + 1023) // 1024, 1, 1)
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                with torch.cuda.graph(g, stream=side):
                    run(grid, torch.cuda.current_stream().cuda_stream, [x.data_ptr(), y.data_ptr(), out.data_ptr(), n])
            torch.cuda.current_stream().wait_stream(side)
            ok = True
            for _ in range(3):
                x.copy_(torch.randn(n, device="cuda"))
                y.copy_(torch.randn(n, device="cuda"))
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                ok &= torch.equal(out, x + y)
            return ok, "captured once, replayed 3x with new inputs"

        def t_overhead():
            s = ks["add"]
            _, f = loaded["add"]
            x = torch.randn(1024, device="cuda")
            args = [x.data_ptr(), x.data_ptr(), x.data_ptr(), 1024]
            run = f.bind(s.arg_types, s.num_warps, s.shared)
            for _ in range(200):
                run((1, 1, 1), stream, args)
            torch.cuda.synchronize()
            best_l = best_b = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(2000):
                    f.launch((1, 1, 1), s.num_warps, s.shared, stream, args, s.arg_types)
                best_l = min(best_l, (time.perf_counter() - t0) / 2000)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(2000):
                    run((1, 1, 1), stream, args)
                best_b = min(best_b, (time.perf_counter() - t0) / 2000)
                torch.cuda.synchronize()
            return True, f"host time per launch: launch() {best_l * 1e6:.2f}us, bound {best_b * 1e6:.2f}us"

        def t_errors():
            m = cd.CudaModule.load(ks["add"].cubin)
            try:
                m.function("nope", 0)
                return False, "no error for a missing kernel"
            except cd.CudaDriverError as e:
                msg = str(e)
            finally:
                m.close()
            return "CUDA_ERROR_NOT_FOUND" in msg, msg[:110]

        for name, fn in [("add eager", t_add), ("add side stream", t_side_stream), ("rowsum masked", t_rowsum),
                         ("matmul >48KiB smem", t_matmul), ("tma global scratch", t_tma_scratch),
                         ("cuda graph replay", t_graph), ("launch overhead", t_overhead),
                         ("error message", t_errors)]:
            check(name, fn)
        for mod, _ in loaded.values():
            mod.close()

    bad = sorted(m for m in sys.modules if _forbidden(m))
    row(my_arch, "no triton/dynamo/inductor in sys.modules", not bad, ", ".join(bad[:5]) or "clean")
    return rows


# ---------------------------------------------------------------------------------------- main


def print_table(rows: list[dict]) -> None:
    w = max(len(r["check"]) for r in rows)
    print(f"{'arch':<6} {'check':<{w}}  {'result':<6} detail")
    print("-" * (w + 60))
    for r in rows:
        print(f"sm_{r['arch']:<3} {r['check']:<{w}}  {'PASS' if r['ok'] else 'FAIL':<6} {r['detail']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--keep", type=Path, help="write cubins here and keep them")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))

    if a.child is not None:
        rows = run_child(a.child)
        print("ROWS " + json.dumps(rows))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to smoke-test")
        return 2
    from aotfuse.runtime.cuda_driver import device_arch

    my_arch = device_arch(torch.cuda.current_device())
    archs = sorted({90, my_arch})
    print(f"device: {torch.cuda.get_device_name()} (sm_{my_arch}); torch {torch.__version__}; "
          f"python {sys.version.split()[0]}; compiling for {['sm_%d' % x for x in archs]}")
    out = a.keep or Path(tempfile.mkdtemp(prefix="aotfuse_smoke_"))
    out.mkdir(parents=True, exist_ok=True)
    rows = build(out, archs)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-X", "importtime", str(Path(__file__).resolve()), "--child", str(out)],
                       capture_output=True, text=True, env=env, cwd=str(REPO))
    imported = []
    other_err = []
    for line in p.stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[-1].strip()
            if _forbidden(name):
                imported.append(name)
        else:
            other_err.append(line)
    child_rows = []
    for line in p.stdout.splitlines():
        if line.startswith("ROWS "):
            child_rows = json.loads(line[5:])
    if p.returncode != 0 or not child_rows:
        rows.append(dict(arch=my_arch, check="run subprocess", ok=False,
                         detail=f"rc={p.returncode}: " + " | ".join(other_err[-8:])[-600:]))
    rows += child_rows
    rows.append(dict(arch=my_arch, check="no triton import (-X importtime)", ok=not imported,
                     detail=", ".join(sorted(set(imported))[:5]) or "clean"))
    if other_err and any(not r["ok"] for r in rows):
        print("\n".join(other_err[-40:]), file=sys.stderr)
    print_table(rows)
    failed = sum(not r["ok"] for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
