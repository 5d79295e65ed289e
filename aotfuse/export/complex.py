"""Complex tensors as real pairs: a complex value of shape S becomes the real tensor of shape S + [2] that
`torch.view_as_real` gives (real part, imaginary part last), so lowering never sees a complex dtype.

The pattern it exists for is the complex rotary embedding (Meta's Llama reference code, transformers' Llama 4 and
DeepSeek-V2): a complex buffer of rotations (`torch.polar`), `view_as_complex` of the query and key pairs, a complex
product, `view_as_real` back. `view_as_complex` / `view_as_real` become the tensor itself; a product of two complex
values is (ac - bd, ad + bc); a product with a real tensor multiplies both parts; views, slices, permutes,
expands, concatenations and copies of a complex value act on the leading dims and keep the pair last; conj negates
the imaginary part. Any other op with a complex operand or result is refused naming it, before lowering.

`realify(gm)` rewrites the graph in place and returns the names of the placeholders whose value was complex: the
caller stores those weights as `torch.view_as_real(w)` (`as_real_weight`). A pure pass over one graph: it runs on
the exported graph (export/capture.py) and on the joint graph (joint/trace.py), whose backward holds the same ops
(the gradient of a product is a product with the conjugate).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..errors import UnsupportedOpError

aten = torch.ops.aten

_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


def is_complex_node(n) -> bool:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype.is_complex


def as_real_weight(t: torch.Tensor) -> torch.Tensor:
    """A complex weight as the pairs the rewritten graph reads (contiguous)."""
    return torch.view_as_real(t.resolve_conj()).contiguous()


def _pos(dim: int, ndim: int) -> int:
    """dim of a complex value with ndim dims, as a non-negative index (the same index in the real pairs)."""
    return dim + ndim if dim < 0 else dim


class _Rewriter:
    def __init__(self, gm: torch.fx.GraphModule):
        self.gm, self.graph = gm, gm.graph
        self.pairs: dict[torch.fx.Node, torch.fx.Node] = {}  # complex node -> its real-pairs node
        # the graph's fake mode: a new node's value is computed in it (a constant made from numbers alone too)
        self.mode = next((v.fake_mode for v in (x.meta.get("val") for x in gm.graph.nodes)
                          if getattr(v, "fake_mode", None) is not None), None)

    def call(self, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
        kwargs = kwargs or {}
        n = self.graph.call_function(target, args, kwargs)

        def val(a):
            if isinstance(a, torch.fx.Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        if self.mode is None:
            n.meta["val"] = target(*val(args), **{k: val(v) for k, v in kwargs.items()})
        else:
            with self.mode:
                n.meta["val"] = target(*val(args), **{k: val(v) for k, v in kwargs.items()})
        return n

    def real(self, n: torch.fx.Node, part: int) -> torch.fx.Node:
        return self.call(aten.select.int, (self.pairs[n], -1, part))

    def stack(self, re: torch.fx.Node, im: torch.fx.Node) -> torch.fx.Node:
        """[..., 2] from the two parts (a cat of the parts unsqueezed: aten.stack is decomposed before lowering)."""
        return self.call(aten.cat.default, ([self.call(aten.unsqueeze.default, (re, -1)),
                                             self.call(aten.unsqueeze.default, (im, -1))], -1))

    def product(self, a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
        ar, ai, br, bi = self.real(a, 0), self.real(a, 1), self.real(b, 0), self.real(b, 1)
        re = self.call(aten.sub.Tensor, (self.call(aten.mul.Tensor, (ar, br)), self.call(aten.mul.Tensor, (ai, bi))))
        im = self.call(aten.add.Tensor, (self.call(aten.mul.Tensor, (ar, bi)), self.call(aten.mul.Tensor, (ai, br))))
        return self.stack(re, im)

    def scaled(self, z: torch.fx.Node, r) -> torch.fx.Node:
        """z times a real operand (a tensor broadcast over the pair, or a number) or a complex number."""
        if isinstance(r, complex):
            zr, zi = self.real(z, 0), self.real(z, 1)

            def lin(x, cx, y, cy):  # cx x + cy y
                return self.call(aten.add.Tensor, (self.call(aten.mul.Tensor, (x, cx)), self.call(aten.mul.Tensor, (y, cy))))

            return self.stack(lin(zr, r.real, zi, -r.imag), lin(zr, r.imag, zi, r.real))
        if isinstance(r, torch.fx.Node):
            if r in self.pairs or is_complex_node(r):
                raise KeyError(r)  # a complex operand only the product form takes
            r = self.call(aten.unsqueeze.default, (r, -1))
        return self.call(aten.mul.Tensor, (self.pairs[z], r))

    def conj(self, z: torch.fx.Node) -> torch.fx.Node:
        return self.stack(self.real(z, 0), self.call(aten.neg.default, (self.real(z, 1),)))

    def rewrite(self, n: torch.fx.Node) -> torch.fx.Node | None:
        """The real-pairs node for complex node n (or for a real node computed from complex operands)."""
        t, a = n.target, n.args
        cx = [x for x in a if isinstance(x, torch.fx.Node) and x in self.pairs]
        zd = n.meta["val"].dim() if is_complex_node(n) else None
        if t is aten.view_as_complex.default:
            return a[0]
        if t is aten.view_as_real.default:
            return self.pairs[a[0]]
        if t in (aten.real.default, aten.imag.default):
            return self.real(a[0], 0 if t is aten.real.default else 1)
        if t is aten.polar.default:  # (abs, angle) -> (abs cos, abs sin)
            return self.stack(self.call(aten.mul.Tensor, (a[0], self.call(aten.cos.default, (a[1],)))),
                              self.call(aten.mul.Tensor, (a[0], self.call(aten.sin.default, (a[1],)))))
        if t is aten.complex.default:  # the parts broadcast to the result's shape first
            shape = list(n.meta["val"].shape)
            return self.stack(*(self.call(aten.expand.default, (x, shape)) for x in a[:2]))
        if t is aten.full.default and zd is not None:  # a complex constant (a scalar operand made a tensor)
            v = complex(a[1])
            kw = {**n.kwargs, "dtype": _REAL_OF[n.meta["val"].dtype]}
            return self.stack(self.call(t, (list(a[0]), v.real), kw), self.call(t, (list(a[0]), v.imag), kw))
        if t is aten.mul.Tensor:
            x, y = a[0], a[1]
            if x in self.pairs and isinstance(y, torch.fx.Node) and y in self.pairs:
                return self.product(x, y)
            return self.scaled(x, y) if x in self.pairs else self.scaled(y, x)
        if t in (aten.add.Tensor, aten.sub.Tensor) and len(cx) == 2 and all(isinstance(x, torch.fx.Node) for x in a[:2]):
            return self.call(t, (self.pairs[a[0]], self.pairs[a[1]]), dict(n.kwargs))
        if t is aten.neg.default:
            return self.call(t, (self.pairs[a[0]],))
        if t in (aten._conj.default, aten.conj_physical.default, aten.conj.default):
            return self.conj(a[0])
        if t in (aten.resolve_conj.default, aten.resolve_neg.default, aten.alias.default, aten.detach.default,
                 aten.clone.default, aten.lift_fresh_copy.default):
            return self.pairs[a[0]]
        if t is aten._to_copy.default:
            dt = n.kwargs.get("dtype")
            kw = {k: v for k, v in n.kwargs.items() if k not in ("dtype", "memory_format")}
            if a[0] not in self.pairs:  # a real tensor made complex: (x, 0)
                x = self.call(aten._to_copy.default, (a[0],), {**kw, "dtype": _REAL_OF[dt]})
                return self.stack(x, self.call(aten.mul.Tensor, (x, 0.0)))
            if dt is not None and dt.is_complex:
                kw["dtype"] = _REAL_OF[dt]
            elif dt is not None:  # complex -> real drops the imaginary part, as torch does (with a warning)
                return self.call(aten._to_copy.default, (self.real(a[0], 0),), {**kw, "dtype": dt})
            return self.call(aten._to_copy.default, (self.pairs[a[0]],), kw)
        if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return self.call(t, (self.pairs[a[0]], list(a[1]) + [2]))
        if t is aten.expand.default:
            return self.call(t, (self.pairs[a[0]], list(a[1]) + [2]))
        if t is aten.permute.default:
            nd = len(a[1])
            return self.call(t, (self.pairs[a[0]], [_pos(d, nd) for d in a[1]] + [nd]))
        src = a[0] if a and isinstance(a[0], torch.fx.Node) else None
        sd = src.meta["val"].dim() if src is not None and is_complex_node(src) else None
        if t is aten.transpose.int:
            return self.call(t, (self.pairs[src], _pos(a[1], sd), _pos(a[2], sd)))
        if t is aten.slice.Tensor:
            return self.call(t, (self.pairs[src], _pos(a[1] if len(a) > 1 else 0, sd), *a[2:]))
        if t is aten.select.int:
            return self.call(t, (self.pairs[src], _pos(a[1], sd), a[2]))
        if t is aten.unsqueeze.default:
            return self.call(t, (self.pairs[src], _pos(a[1], zd)))
        if t in (aten.squeeze.dim, aten.squeeze.dims):
            dims = a[1] if isinstance(a[1], (list, tuple)) else [a[1]]
            return self.call(aten.squeeze.dims, (self.pairs[src], [_pos(d, sd) for d in dims]))
        if t is aten.cat.default and all(x in self.pairs for x in a[0]):
            nd = a[0][0].meta["val"].dim()
            return self.call(t, ([self.pairs[x] for x in a[0]], _pos(a[1] if len(a) > 1 else 0, nd)))
        return None


def realify(gm: torch.fx.GraphModule) -> set[str]:
    """Rewrite every complex value of gm into real pairs (in place); the complex placeholders' names."""
    graph = gm.graph
    if not any(is_complex_node(n) for n in graph.nodes):
        return set()
    rw = _Rewriter(gm)
    placeholders: set[str] = set()
    dead: list = []
    for n in list(graph.nodes):
        if n.op == "placeholder":
            if is_complex_node(n):
                n.meta["val"] = torch.view_as_real(n.meta["val"])
                rw.pairs[n] = n
                placeholders.add(n.name)
            continue
        if n.op != "call_function":
            continue
        operands = [x for x in n.all_input_nodes if x in rw.pairs]
        if not operands and not is_complex_node(n):
            continue
        if n.target is aten._assert_tensor_metadata.default:  # a dtype check on the complex value: dropped
            dead.append(n)
            continue
        if n.target is operator.getitem:
            raise UnsupportedOpError(str(n.target), n.name, "a complex value inside a tuple result")
        with graph.inserting_before(n):
            try:
                new = rw.rewrite(n)
            except KeyError:  # an operand the op's pair form needs complex is real (or the other way): no form
                new = None
        if new is None:
            raise UnsupportedOpError(str(n.target), n.name,
                                     "complex tensors are computed as real pairs, and this op on a complex value has "
                                     "no pair form (supported: view_as_complex/real, polar, complex, full, real, "
                                     "imag, mul, add, sub, neg, conj, views, permutes, slices, expand, cat, copies)",
                                     remedy="compute it on real tensors (the real and imaginary parts, as "
                                            "torch.view_as_real gives them; a rotation with cos and sin, as "
                                            "transformers' Llama does)")
        if is_complex_node(n):
            rw.pairs[n] = new
            dead.append(n)
        else:  # a real result (view_as_real, real, imag, a cast to a real dtype): the pairs replace it
            n.replace_all_uses_with(new)
            dead.append(n)
    for n in reversed(dead):
        if n.users:  # every call reading it was rewritten (and erased first): what is left returns it
            raise UnsupportedOpError(str(n.target), n.name, "a complex result returned by the model",
                                     remedy="return torch.view_as_real(result) (the pairs) instead")
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return placeholders
