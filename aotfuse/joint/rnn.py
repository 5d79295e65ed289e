"""nn.LSTM in the joint trace: `torch.lstm` (the input form) routed to torch's Python decomposition, one
`F.linear` per projection, so that every parameter gets its own gradient node.

Without the route `aten.lstm` runs as a fused layer (oneDNN's `mkldnn_rnn_layer` for CPU tensors, a fused
cell on CUDA) whose backward hands one node to both `bias_ih` and `bias_hh` (the two biases are only ever
summed). aot_export_module maps gradients
to parameters by node name and fails on that (`len(gradients_to_parameters) != len(backward_output_names)`).
Through the decomposition each bias is its own `addmm`'s, and the backward carries two reductions, which
the partitioner is free to share. The packed-sequence form (`lstm.data`, data-dependent batch sizes) is
left as it is: the trace refuses it by name. nn.GRU and nn.RNN are not routed: their cells keep the two
biases apart already."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def _lstm_input_form(args, kwargs) -> bool:
    """torch.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first): hx is a
    sequence of two tensors (the packed form passes batch_sizes, a tensor, second)."""
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return isinstance(hx, (list, tuple))


class lstm_mode(TorchFunctionMode):
    """torch.lstm (what nn.LSTM.forward calls through torch._VF) -> torch._decomp's lstm_impl."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.lstm and _lstm_input_form(args, kwargs):
            from torch._decomp.decompositions import lstm_impl

            # torch picks a fused oneDNN layer for CPU tensors whose input needs no gradient (its backward is one
            # node for both biases too); the trace wants the per-op form on every device
            was = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)  # (torch.backends.mkldnn.flags also sets oneDNN's TF32, with a warning)
            try:
                return lstm_impl(*args, **kwargs)
            finally:
                torch._C._set_mkldnn_enabled(was)
        return func(*args, **kwargs)
