"""Cross-entropy in the joint trace as `logsumexp(x) - x[target]`: one pass over the logits each way.

`F.cross_entropy` is CompositeImplicitAutograd: above autograd it becomes `log_softmax` + `nll_loss`,
whose decompositions (decomp_train.py) read the logits three times in the forward (max, sum of
exponentials, and the one-hot pick of the normalized log-probabilities, which needs both) and
materialize nothing but still make a looped kernel walk each row three times. `cross_entropy_mode`
(a TorchFunctionMode, like `sdpa_math_mode`) routes the common form instead to

    m      = max(x, C).detach()               # a shift only: no gradient flows through it
    lse    = m + log(sum(exp(x - m), C))      # max and sum fuse into one online pass (emit/online.py)
    picked = sum(where(arange(C) == t, x, 0), C)   # reads only x and t: the same pass
    loss   = reduce(where(valid, (lse - picked) * w, 0))

whose gradient, traced by aot_autograd from these ops, is `g * exp(x - m) / s - onehot * g`: one
read of x and one write of the gradient. Numerically it is torch's log-softmax form rearranged
(fp32 math for half inputs, as torch upcasts).

Routed: logits [N, C] or [C] of a float dtype, class-index targets (integer dtype), any reduction,
`ignore_index`, an optional class `weight`. Anything else (probability targets, label smoothing,
[N, C, d...] inputs) goes to torch's own path, as before.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
_REDUCTIONS = ("none", "mean", "sum")


def _routable(x, target, weight, size_average, reduce, reduction, label_smoothing) -> bool:
    if size_average is not None or reduce is not None or reduction not in _REDUCTIONS or label_smoothing:
        return False
    if not (isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor)) or not x.is_floating_point():
        return False
    if target.is_floating_point() or target.dtype == torch.bool:
        return False  # class probabilities: torch's path
    if x.dim() == 2:  # sizes compared without a guard (a dynamic batch: equal or not known to be)
        ok = target.dim() == 1 and statically_known_true(target.shape[0] == x.shape[0])
    elif x.dim() == 1:
        ok = target.dim() == 0
    else:
        return False
    return ok and (weight is None or (isinstance(weight, torch.Tensor) and weight.dim() == 1 and
                                      statically_known_true(weight.shape[0] == x.shape[-1])))


def cross_entropy_lse(x, target, weight=None, ignore_index: int = -100, reduction: str = "mean"):
    """The routed formula (see the module docstring); same result and dtype as F.cross_entropy."""
    one = x.dim() == 1
    if one:
        x, target = x.unsqueeze(0), target.unsqueeze(0)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    c = xf.shape[1]
    m = torch.amax(xf, 1, keepdim=True).detach()
    lse = (m + torch.log(torch.sum(torch.exp(xf - m), 1, keepdim=True))).squeeze(1)
    classes = torch.arange(c, dtype=target.dtype, device=x.device)
    onehot = classes.unsqueeze(0) == target.unsqueeze(1)
    picked = torch.sum(torch.where(onehot, xf, 0.0), 1)
    valid = target != ignore_index
    if weight is not None:
        w = torch.sum(torch.where(onehot, weight.to(xf.dtype).unsqueeze(0), 0.0), 1)
        w = torch.where(valid, w, 0.0)
    else:
        w = valid.to(xf.dtype)
    losses = torch.where(valid, (lse - picked) * w, 0.0)
    if reduction == "none":
        out = losses.squeeze(0) if one else losses
    elif reduction == "sum":
        out = losses.sum()
    else:
        out = losses.sum() / w.sum()
    return out.to(x.dtype)


class cross_entropy_mode(TorchFunctionMode):
    """Routes F.cross_entropy to `cross_entropy_lse` where it applies; counts the calls it routed
    (`routed`) and the ones left to torch with why (`kept`)."""

    def __init__(self):
        super().__init__()
        self.routed = 0
        self.kept: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy:
            return self._ce(*args, **kwargs)
        return func(*args, **kwargs)

    def _ce(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0):
        if _routable(input, target, weight, size_average, reduce, reduction, label_smoothing):
            self.routed += 1
            return cross_entropy_lse(input, target, weight, int(ignore_index), reduction)
        self.kept.append(f"input {list(getattr(input, 'shape', []))}, reduction {reduction!r}, "
                         f"label_smoothing {label_smoothing}")
        return torch.nn.functional.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                                 reduction, label_smoothing)
