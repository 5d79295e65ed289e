"""The mechanism behind replay_crash.py, in isolation: a CUDA graph that reuses a cuBLAS workspace it
does not own replays into freed memory once that workspace's owner is gone.

cuBLAS keeps one workspace per (handle, stream). torch.cuda.graph() captures on one default stream
shared by every capture in the process, so graph B reuses the workspace allocated while capturing
graph A, which lives in A's private pool. Delete A, let anyone clear the workspace map (torch.compile's
reduce-overhead mode does, around each capture) and release cached memory: B's kernels now read and
write an address that is no longer B's. With aotfuse's protocol (own capture stream, map cleared before
and after capture, runtime/graphs.py) B's workspace is allocated in B's own pool.

    python scripts/repro/workspace_ownership.py shared   # torch.cuda.graph() as the old runtime used it
    python scripts/repro/workspace_ownership.py owned    # runtime/graphs.py's protocol
Prints 'ok' with the max error of B's replays against eager, or dies with a CUDA error.
"""
import sys

import torch

mode = sys.argv[1] if len(sys.argv) > 1 else "owned"
torch.manual_seed(0)
dev = "cuda"
# shapes for which cuBLAS(Lt) picks split-K kernels that use the workspace
mats = [(torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(k, n, device=dev, dtype=torch.bfloat16))
        for m, k, n in ((64, 65536, 64), (128, 32768, 96), (256, 16384, 256), (1024, 1024, 1024))]


def prog():
    return [a @ b for a, b in mats]


def capture(owned: bool):
    g = torch.cuda.CUDAGraph()
    if owned:
        from aotfuse.runtime.graphs import _clear_library_workspaces
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        _clear_library_workspaces()
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            out = prog()
            g.capture_end()
        _clear_library_workspaces()
        torch.cuda.current_stream().wait_stream(s)
    else:
        with torch.cuda.graph(g):
            out = prog()
    return g, out


ref = prog()
torch.cuda.synchronize()
owned = mode == "owned"
gA, oA = capture(owned)
gB, oB = capture(owned)
del gA, oA
torch._C._cuda_clearCublasWorkspaces()   # torch.compile(mode="reduce-overhead") does this around its captures
torch.cuda.empty_cache()                 # released pools go back to the driver
junk = [torch.full((16 << 20,), 7.0, device=dev) for _ in range(16)]  # reuse the freed addresses
for _ in range(50):
    gB.replay()
torch.cuda.synchronize()
err = max(float((o.float() - r.float()).abs().max() / r.float().abs().max()) for o, r in zip(oB, ref))
junk_ok = all(bool((j == 7.0).all()) for j in junk)
print(f"{mode}: max rel err of B's replays {err:.2e}, other tensors intact: {junk_ok}")
print("ok" if err < 1e-2 and junk_ok else "WRONG")
