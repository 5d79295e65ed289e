"""torch.export capture: module + example inputs -> core-ATen FX graph, weights, input specs."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.fx

from ..contract.manifest import InputSpec as ContractInputSpec
from ..dtypes import input_kind
from ..errors import BuildError
from .decomp import decomposition_table
from .ranges import int_range


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "float" | "int" | "bool"
    low: int | None = None  # for int inputs: the valid value range [low, high)
    high: int | None = None

    def to_contract(self) -> ContractInputSpec:
        """The manifest's form (dtype spelled as torch prints it, "torch.float32")."""
        return ContractInputSpec(self.name, tuple(self.shape), str(self.dtype), self.kind, self.low, self.high)

    @classmethod
    def of(cls, name: str, ph: torch.fx.Node, t: torch.Tensor) -> "InputSpec":
        """The spec of example input `t` at placeholder `ph` (exported or joint graph alike)."""
        kind = input_kind(t.dtype)
        lo, hi = int_range(ph, t) if kind == "int" else (None, None)
        return cls(name, tuple(t.shape), t.dtype, kind, lo, hi)


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """The export stage's value: an FX graph in core ATen plus what its placeholders mean."""

    gm: torch.fx.GraphModule
    # placeholder name -> ("weight", fqn) | ("input", index)
    placeholders: tuple[tuple[str, str, Any], ...]
    weights: dict[str, torch.Tensor]  # fqn -> tensor (parameters, buffers, lifted constants)
    inputs: tuple[InputSpec, ...]
    single_output: bool
    seconds: float


def capture(model: torch.nn.Module, example_inputs: tuple, *, train: bool = False) -> CapturedGraph:
    t0 = time.perf_counter()
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise BuildError(f"example input {i} is a {type(x).__name__}; only tensors are supported",
                             remedy="wrap scalars and structures in the model's forward")
    try:
        ep = torch.export.export(model, example_inputs, strict=False)
        ep = ep.run_decompositions(decomposition_table())
    except Exception as exc:  # torch raises many types here; name the stage and the cause
        raise BuildError(f"torch.export failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                         remedy="check that the model exports with torch.export.export(model, inputs)") from exc
    sig = ep.graph_signature
    state = dict(ep.state_dict)
    state.update(ep.constants)
    ph_map: dict[str, Any] = {}
    ph_map.update({k: v for k, v in sig.inputs_to_parameters.items()})
    ph_map.update({k: v for k, v in sig.inputs_to_buffers.items()})
    ph_map.update({k: v for k, v in sig.inputs_to_lifted_tensor_constants.items()})
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    placeholders = []
    weights = {}
    ph_by_name = {}
    for node in ep.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        ph_by_name[node.name] = node
        if node.name in ph_map:
            fqn = ph_map[node.name]
            weights[fqn] = state[fqn].detach().contiguous()
            placeholders.append((node.name, "weight", fqn))
        elif node.name in user_inputs:
            placeholders.append((node.name, "input", user_inputs.index(node.name)))
        else:
            raise BuildError(f"placeholder {node.name} is neither a user input nor a weight")
    specs = [InputSpec.of(name, ph_by_name[name], example_inputs[idx]) for idx, name in enumerate(user_inputs)]
    out_spec = ep.call_spec.out_spec
    single = out_spec is not None and out_spec.num_leaves == 1 and out_spec.type not in (tuple, list)
    return CapturedGraph(ep.graph_module, tuple(placeholders), weights, tuple(specs), single,
                         time.perf_counter() - t0)
