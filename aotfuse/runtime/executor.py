"""Runs a program: binds inputs and weights, walks the instruction list, returns the outputs.

The same executor serves the GPU (kernels launched through the CUDA driver) and the CPU (kernels run
by Triton's interpreter); only the kernel launcher differs.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ArchiveError
from .externs import resolve

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
          "uint8": torch.uint8, "bool": torch.bool}


_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ArchiveError(f"program names unknown dtype {name!r}") from None


def new_seed(device) -> torch.Tensor:
    """A Philox seed for one call, drawn from torch's default generator (so torch.manual_seed applies)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(device, non_blocking=True)


def _contig_strides(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class Executor:
    """Compiled once per (program, device); called per inference. Holds no per-call state."""

    def __init__(self, program: dict, weights: dict[str, torch.Tensor], launchers: dict[str, Callable],
                 device: torch.device):
        self.program = program
        self.device = device
        self.weight_env = {buf: weights[fqn] for buf, fqn in program["weights"].items()}
        self.launchers = launchers
        self.steps = [self._prepare(ins) for ins in program["instructions"]]

    def _prepare(self, ins: dict):
        op = ins["op"]
        if op == "alloc":
            dt = torch_dtype(ins["dtype"])
            shape = tuple(ins["shape"])
            n = 1
            for d in shape:
                n *= d
            return ("alloc", ins["buf"], ins["offset"], shape, dt, n * _ITEMSIZE[dt])
        if op == "launch":
            if ins["kernel"] not in self.launchers:
                raise ArchiveError(f"program launches kernel {ins['kernel']!r} that the archive does not contain")
            return ("launch", self.launchers[ins["kernel"]], tuple(ins["grid"]), tuple(ins["args"]))
        if op == "extern":
            return ("extern", resolve(ins["target"]), ins)
        if op == "free":
            return ("free", tuple(ins["bufs"]))
        if op == "return":
            return ("return", ins["outputs"])
        raise ArchiveError(f"unknown program instruction {op!r}")

    def run(self, inputs: list[torch.Tensor], seed: torch.Tensor | None = None) -> list[torch.Tensor]:
        env = dict(self.weight_env)
        for spec, t in zip(self.program["inputs"], inputs):
            env[spec["buf"]] = t
        if self.program.get("rng"):
            env[self.program["rng"]] = seed if seed is not None else new_seed(self.device)
        arena = torch.empty(self.program["arena_bytes"], dtype=torch.uint8, device=self.device)
        for step in self.steps:
            kind = step[0]
            if kind == "launch":
                _, launch, grid, args = step
                launch(grid, [env[b] for b in args])
            elif kind == "alloc":
                _, buf, off, shape, dt, nbytes = step
                if off < 0:
                    env[buf] = torch.empty(shape, dtype=dt, device=self.device)
                else:
                    env[buf] = arena[off:off + nbytes].view(dt).view(shape)
            elif kind == "extern":
                self._extern(step[1], step[2], env)
            elif kind == "free":
                for b in step[1]:
                    env.pop(b, None)
            else:
                return [self._view(o, env) for o in step[1]]
        raise ArchiveError("program has no return instruction")

    def _view(self, a: dict, env) -> torch.Tensor:
        base = env[a["t"]]
        return base.as_strided(a["shape"], a["stride"], base.storage_offset() + a["offset"])

    def _decode(self, a, env):
        if isinstance(a, dict) and "t" in a:
            return self._view(a, env)
        if isinstance(a, list):
            return [self._decode(x, env) for x in a]
        return a

    def _extern(self, fn, ins: dict, env):
        args = [self._decode(a, env) for a in ins["args"]]
        kwargs = {k: self._decode(v, env) for k, v in ins["kwargs"].items()}
        out = ins["out"]
        ov = ins["out_view"]
        if ins["out_variant"]:
            fn(*args, **kwargs, out=self._view(ov, env))
            return
        result = fn(*args, **kwargs)
        shape = tuple(ins["shape"])
        if tuple(result.stride()) == tuple(ov["stride"]):
            # The op wrote the layout we planned for (e.g. flash attention's [B, T, H, D]): bind it.
            base_off = result.storage_offset() - ov["offset"]
            if base_off >= 0:
                env[out] = result.as_strided(shape, _contig_strides(shape), base_off)
                return
        base = torch.empty(shape, dtype=torch_dtype(ins["dtype"]), device=result.device)
        base.as_strided(ov["shape"], ov["stride"], ov["offset"]).copy_(result)
        env[out] = base
