"""The typed contracts between the build (emit/, pipeline) and the runtime: what an archive's payload
holds, as frozen dataclasses with `to_dict()` / `from_dict()`.

- `program`:  Program, its instructions (Alloc, Launch, Extern, Free, Return), TensorRef, and the
  payload version (PROGRAM_VERSION, checked at load by `check_program_version`); `specialize` and
  `program_dims` for dynamic dims;
- `sizes`:    size expressions over dynamic dims (`check_size`, `compile_size`, `evaluate`, `free_dims`);
- `kernels`:  KernelEntry, KernelArg, Binary (the `kernels` part);
- `manifest`: Manifest, InputSpec, OutputSpec, TrainInfo, DimSpec;
- `report`:   Report and its sections (the `report` part: informational).

Stdlib only (no torch, no triton): the runtime and the build both import it. `to_dict()` gives the
exact msgpack-ready dict an archive stores (same keys, same order: builds stay byte-identical);
`from_dict()` reads one back. Readers call `from_dict` on data `runtime/validate.py` has checked;
even unchecked, a malformed dict is an `ArchiveError`, never a KeyError or TypeError.
The specification of every field is artifacts/FORMAT.md, "Payload".
"""
from __future__ import annotations

from .kernels import Binary, KernelArg, KernelEntry, kernels_from_dict, kernels_to_dict, specialize_kernel
from .manifest import DimSpec, InputSpec, Manifest, OutputSpec, TrainInfo
from .program import (DIMS_VERSION, DONOR_VERSION, MAX_SUPPORTED_VERSION, MIN_SUPPORTED_VERSION, PROGRAM_VERSION, Alloc, Extern,
                      ExternOut, Free, Instruction, Launch, Program, ProgramInput, Return, TensorRef, WeightSpec,
                      check_program_version, program_dims, specialize)
from .report import (FusionRecord, FusionSummary, GroupRecord, InlineRecord, MemorySummary, Report)
from .sizes import SizeExpr, check_size, compile_size, evaluate, free_dims

__all__ = ["Binary", "KernelArg", "KernelEntry", "kernels_from_dict", "kernels_to_dict", "specialize_kernel",
           "DimSpec", "InputSpec", "Manifest", "OutputSpec", "TrainInfo", "DIMS_VERSION", "DONOR_VERSION", "MAX_SUPPORTED_VERSION",
           "MIN_SUPPORTED_VERSION", "PROGRAM_VERSION", "Alloc", "Extern", "ExternOut", "Free", "Instruction", "Launch",
           "Program", "ProgramInput", "Return", "TensorRef", "WeightSpec", "check_program_version", "program_dims",
           "specialize", "FusionRecord", "FusionSummary", "GroupRecord", "InlineRecord", "MemorySummary", "Report",
           "SizeExpr", "check_size", "compile_size", "evaluate", "free_dims"]
