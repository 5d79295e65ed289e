"""Train-mode BatchNorm with `momentum=None` (a cumulative moving average) in the joint trace.

`_BatchNorm.forward` computes that average's factor in Python, `1.0 / float(num_batches_tracked)`:
a read of a tensor's value, which a traced program cannot do (the trace would stop with a
data-dependent error). While the joint graph is traced, `cumulative_average_batchnorm(model)` gives
each such module a forward that computes the factor as a tensor instead, with the same result:

    num_batches_tracked += 1;  f = 1 / num_batches_tracked
    out = batch_norm(x, ..., copies of the running stats, training=True, momentum=1.0)
                                    # the copies := the batch mean and unbiased variance
    running_stat = f * batch_stat + (1 - f) * running_stat

(ATen's update with momentum f, computed in fp32 and stored in the buffer's dtype). The in-place
updates are buffer mutations like any other: the forward program returns the new values and the
runtime writes them into the module's buffers. Only modules that use `_BatchNorm.forward` itself
(BatchNorm1d/2d/3d) get it; a subclass with its own forward keeps it (and a data-dependent read in
it is refused as one, naming the line).
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _uses_cumulative_average(m: torch.nn.Module) -> bool:
    return (isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward and m.training
            and m.track_running_stats and m.momentum is None and m.num_batches_tracked is not None
            and m.running_mean is not None and m.running_var is not None)


def _cumulative_forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """`_BatchNorm.forward` for training with momentum=None, with the factor kept a tensor."""
    self._check_input_dim(x)
    self.num_batches_tracked.add_(1)
    f = 1.0 / self.num_batches_tracked.to(torch.float32)
    # momentum 1 on copies: they become the batch mean and unbiased variance (autograd keeps them for
    # the backward, so they are never written again)
    batch_mean, batch_var = self.running_mean.clone(), self.running_var.clone()
    out = F.batch_norm(x, batch_mean, batch_var, self.weight, self.bias, True, 1.0, self.eps)
    with torch.no_grad():  # statistics carry no gradient (as in ATen's in-place update)
        for buf, batch in ((self.running_mean, batch_mean), (self.running_var, batch_var)):
            buf.copy_((f * batch.float() + (1.0 - f) * buf.float()).to(buf.dtype))
    return out


@contextlib.contextmanager
def cumulative_average_batchnorm(model: torch.nn.Module):
    """While tracing: BatchNorm modules in training with momentum=None use `_cumulative_forward`."""
    patched = [m for m in model.modules() if _uses_cumulative_average(m)]
    for m in patched:
        m.forward = types.MethodType(_cumulative_forward, m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
