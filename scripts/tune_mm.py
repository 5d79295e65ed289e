"""Matmul template tiles on a GPU: the anchor GPT's matmuls (d768, vocab 8192, bf16), each with the
epilogue it has in the model, timed per tile configuration against cuBLAS + a separate epilogue
(eager) and aotfuse's extern lowering (cuBLAS, the GELU in cuBLASLt's epilogue).

    python3 scripts/tune_mm.py [--rows 8192,128] [--cases qkv,out,fc,proj,head] [--configs C;C] [--json FILE]

Every contender is one module (Linear + its epilogue) built with AOTFUSE_MM=template and
AOTFUSE_MM_CONFIG=<config> (or AOTFUSE_MM=extern) for this GPU's arch only, in parallel processes
(a build needs no GPU), then loaded and timed here: the program's executor is captured in a CUDA
graph and the graph replayed: all contenders of a case are captured first and then timed round-robin (median
of 7 rounds of N replays each, CUDA events), so the GPU's clock drift moves them alike. Each output is checked against eager (relative error of the norm). The table prints last:
per case the eager and extern times, the best template configuration and its time, and the ratio.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

D, VOCAB = 768, 8192

# (name, K, N, epilogue): the anchor's per-layer matmuls and its head
CASES = {
    "qkv": (D, 3 * D, "bias"),
    "out": (D, D, "residual"),
    "fc": (D, 4 * D, "gelu"),
    "proj": (4 * D, D, "residual"),
    "head": (D, VOCAB, "none"),
}

WRONG = 2e-2  # relative error (norm) past which a configuration's result counts as wrong (bf16 noise: ~3e-3)

# BM, BN, BK, GROUP_M, WARPS, STAGES
LARGE = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4)]  # one program per tile, for reference
# persistent (7th value 1: one program per SM, operands through TMA descriptors)
LARGE += [(128, 256, 64, 8, 8, 3, 1), (128, 128, 64, 8, 8, 4, 1), (128, 128, 64, 8, 4, 4, 1),
          (128, 128, 64, 8, 8, 3, 1), (256, 128, 64, 8, 8, 3, 1), (64, 256, 64, 8, 4, 4, 1),
          (128, 256, 128, 8, 8, 2, 1), (128, 128, 128, 8, 8, 3, 1), (128, 128, 128, 8, 4, 3, 1),
          (128, 256, 64, 4, 8, 3, 1), (128, 256, 64, 16, 8, 3, 1), (128, 256, 64, 1, 8, 3, 1),
          (128, 128, 64, 4, 8, 4, 1), (128, 128, 64, 16, 8, 4, 1), (128, 128, 64, 1, 4, 4, 1),
          (128, 256, 32, 8, 8, 5, 1), (128, 128, 32, 8, 4, 6, 1),
          (128, 128, 64, 8, 4, 3, 2)]
# warp-specialized persistent (8th value 1: a producer and two consumer warpgroups of WARPS each)
LARGE += [(128, 256, 64, 8, 4, 3, 1, 1), (128, 256, 64, 8, 4, 4, 1, 1), (128, 128, 64, 8, 4, 4, 1, 1),
          (128, 128, 128, 8, 4, 3, 1, 1), (128, 128, 128, 8, 4, 4, 1, 1), (128, 256, 64, 16, 4, 4, 1, 1),
          (128, 256, 64, 4, 4, 3, 1, 1), (256, 128, 64, 8, 4, 3, 1, 1)]
MID = [(64, 128, 64, 8, 4, 4), (64, 64, 128, 8, 4, 3), (128, 128, 64, 8, 4, 4, 1), (64, 64, 64, 8, 4, 4, 1),
       (128, 64, 64, 8, 4, 4, 1), (64, 128, 64, 8, 4, 4, 1), (128, 128, 64, 8, 8, 4, 1),
       (128, 128, 64, 8, 4, 4, 1, 1), (128, 64, 64, 8, 4, 4, 1, 1), (128, 256, 64, 8, 4, 3, 1, 1)]
SMALL = [
    (64, 64, 64, 8, 4, 4), (64, 32, 64, 8, 4, 4), (32, 64, 64, 8, 4, 4), (64, 64, 128, 8, 4, 3),
    (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (32, 32, 128, 8, 4, 3), (64, 32, 128, 8, 4, 4),
    (16, 64, 128, 8, 4, 4), (64, 64, 64, 8, 4, 2), (128, 32, 64, 8, 4, 4), (64, 16, 128, 8, 4, 4),
]


class Lin(torch.nn.Module):
    def __init__(self, k, n, epi):
        super().__init__()
        self.fc = torch.nn.Linear(k, n, bias=epi != "none")
        self.epi = epi

    def forward(self, x, r):
        y = self.fc(x)
        if self.epi == "gelu":
            return F.gelu(y, approximate="tanh")
        if self.epi == "residual":
            return y + r
        return y


def make(case: str, rows: int, device="cpu"):
    k, n, epi = CASES[case]
    torch.manual_seed(0)
    m = Lin(k, n, epi).to(torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    r = torch.randn(rows, n, dtype=torch.bfloat16)
    return m.to(device), (x.to(device), r.to(device))


def build_one(job):
    """(key, path, error): runs in a worker process."""
    case, rows, mode, cfg, arch, path = job
    try:
        from aotfuse.knobs import override

        import aotfuse

        model, inputs = make(case, rows)
        with override(mm=mode, mm_config=",".join(map(str, cfg)) if cfg else "", targets=(arch,),
                      compile_workers=1), torch.no_grad():
            aotfuse.build(model, inputs, targets=(arch,)).save(path)
        return job, None
    except Exception as e:  # a config Triton refuses (shared memory) is a result, not a crash
        return job, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,128")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=None,
                    help="only these configurations, ';'-separated (e.g. 128,128,128,8,4,3,1,1;128,256,64,8,8,3,1)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    a = ap.parse_args()
    import aotfuse
    from aotfuse.knobs import override
    from bench_kernels import _median_events, capture_graph as capture, rel_err

    def replay_us(g, iters):  # one round of `iters` replays
        return _median_events(g.replay, iters, rounds=1) * 1e3

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    tmp = tempfile.mkdtemp(prefix="tune_mm_")
    jobs = []
    for rows in (int(r) for r in a.rows.split(",")):
        for case in a.cases.split(","):
            cfgs = LARGE if rows >= 4096 else MID if rows >= 512 else SMALL
            if a.configs:
                cfgs = [tuple(int(v) for v in c.split(",")) for c in a.configs.split(";") if c]
            jobs.append((case, rows, "extern", None, arch, f"{tmp}/{case}_{rows}_extern.aotf"))
            jobs.append((case, rows, "template", (), arch, f"{tmp}/{case}_{rows}_table.aotf"))  # the table's choice
            jobs.extend((case, rows, "template", c, arch, f"{tmp}/{case}_{rows}_{'_'.join(map(str, c))}.aotf")
                        for c in cfgs)
    t0 = time.time()
    built = {}
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(a.workers, mp_context=ctx) as pool:
        for job, err in pool.map(build_one, jobs):
            built[job] = err
    print(f"built {len(jobs)} archives in {time.time() - t0:.0f}s with {a.workers} workers", flush=True)

    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for case in a.cases.split(","):
            model, inputs = make(case, rows, "cuda")
            rec = {"case": case, "rows": rows, "K": CASES[case][0], "N": CASES[case][1], "epilogue": CASES[case][2],
                   "templates": []}
            with torch.no_grad():
                want = model(*inputs)
                # contenders: (key, entry, graph); every graph is captured first, then all are timed
                # round-robin, so clock drift over the run moves every contender alike
                contenders = [("eager", {}, capture(lambda: model(*inputs)))]
                keep = []
                for job, err in built.items():
                    if job[0] != case or job[1] != rows:
                        continue
                    variants = [(job[2] if job[3] != () else "table", {})]
                    if job[2] == "extern":  # also with matmul externs through torch's binding (cuBLAS)
                        variants.append(("extern_torch", {"cublaslt": False}))
                    for key, kn in variants:
                        entry = {"config": job[3]}
                        if not err:
                            try:
                                with override(**kn):
                                    art = aotfuse.load(job[5], device="cuda", cuda_graphs=False)
                                    ex = art.executors["forward"]
                                    st = ex.state()
                                got = ex.run(list(inputs), state=st)[0]
                                entry.update(rel_err=float(f"{rel_err(got, want):.2e}"), kernels=len(art.kernels))
                                keep.append((art, ex, st))
                                contenders.append((key, entry, capture(
                                    lambda ex=ex, st=st: ex.run(list(inputs), state=st))))
                            except Exception as e:  # e.g. more shared memory than the device allows
                                err = f"load: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        if err:
                            entry["error"] = err
                        if key == "template":
                            rec["templates"].append(entry)
                        else:
                            rec[key] = entry
                times: dict[int, list] = {i: [] for i in range(len(contenders))}
                for _ in range(a.rounds):
                    for i, (_, _, g) in enumerate(contenders):
                        times[i].append(replay_us(g, a.iters))
                for i, (key, entry, _) in enumerate(contenders):
                    entry["us"] = round(statistics.median(times[i]), 2)
                rec["eager_us"] = contenders[0][1]["us"]
                del keep, contenders
            # a configuration whose result is off (NaN, or far from eager: a miscompile) is no contender
            for t in rec["templates"]:
                if "us" in t and not (t.get("rel_err", 0.0) <= WRONG):
                    t["wrong"] = True
                    print(f"WRONG {case} {rows} {t['config']}: rel err {t.get('rel_err')}", flush=True)
            ok = [t for t in rec["templates"] if "us" in t and not t.get("wrong")]
            ok.sort(key=lambda t: t["us"])
            rec["templates"] = ok + [t for t in rec["templates"] if "us" not in t or t.get("wrong")]
            results.append(rec)
            print(json.dumps(rec), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "arch": arch, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                       time.gmtime()), "results": results}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} ({arch}), kernel time per call (graph replay, median), us")
    print(f"{'case':6} {'rows':>5} {'K':>5} {'N':>5} {'epilogue':9} {'eager':>8} {'extern':>8} {'ext/torch':>9} "
          f"{'table':>8} {'template':>9} {'best config':28} {'tmpl/ext':>8} {'err':>8}")
    nan = float("nan")
    for r in results:
        best = r["templates"][0] if r["templates"] and "us" in r["templates"][0] else None
        ext = r.get("extern", {}).get("us")
        print(f"{r['case']:6} {r['rows']:5} {r['K']:5} {r['N']:5} {r['epilogue']:9} {r['eager_us']:8.1f} "
              f"{ext if ext is not None else nan:8.1f} {r.get('extern_torch', {}).get('us', nan):9.1f} "
              f"{r.get('table', {}).get('us', nan):8.1f} {best['us'] if best else nan:9.1f} "
              f"{','.join(map(str, best['config'])) if best else '-':28} "
              f"{(best['us'] / ext) if best and ext else float('nan'):8.2f} {best['rel_err'] if best else '-':>8}")


if __name__ == "__main__":
    main()
