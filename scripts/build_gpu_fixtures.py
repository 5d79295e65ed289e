"""Build, on this CPU-only machine, the archives the GPU tier loads (written under build/)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import aotfuse
from aotfuse.specs import load_spec

FIXTURES = {
    "gpt_fp32": "aotfuse.examples.gpt:demo",
    "gpt_bf16": "aotfuse.examples.gpt:demo_bf16",
    "gpt_fp32_b8": "aotfuse.examples.gpt:demo(batch=8)",
    "gpt_bf16_b8": "aotfuse.examples.gpt:demo_bf16(batch=8)",
    "llama_fp32": "aotfuse.examples.llama:block",
    "llama_bf16": "aotfuse.examples.llama:block_bf16",
    "cnn_fp32": "aotfuse.examples.cnn:cnn",
    "cnn_fp16": "aotfuse.examples.cnn:cnn_fp16",
}


TRAIN_FIXTURES = {
    "demo_train_fp32_drop": "aotfuse.examples.gpt:demo_train(dropout=0.1)",
    "demo_train_fp32_nodrop": "aotfuse.examples.gpt:demo_train(dropout=0.0)",
    "demo_train_bf16_drop": "aotfuse.examples.gpt:demo_train(dropout=0.1, dtype=torch.bfloat16)",
    "demo_train_bf16_nodrop": "aotfuse.examples.gpt:demo_train(dropout=0.0, dtype=torch.bfloat16)",
}


def main(out_dir: str = "build/gpu", only: list[str] | None = None, train: bool = False) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, spec in (TRAIN_FIXTURES if train else FIXTURES).items():
        if only and name not in only:
            continue
        model, inputs = load_spec(spec)
        t0 = time.perf_counter()
        res = aotfuse.build(model, inputs, train=train)
        secs = time.perf_counter() - t0
        res.save(out / f"{name}.aotf")
        index[name] = {"spec": spec, "build_seconds": round(secs, 2), "bytes": len(res.data)}
        print(f"{name:14s} {secs:6.2f}s {len(res.data):>10d} B  {res.report.fusion_summary.kernel_launches} kernels")
    (out / "index.json").write_text(json.dumps(index, indent=1))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--train"]
    main(*args[:1], only=args[1:] or None, train="--train" in sys.argv)
