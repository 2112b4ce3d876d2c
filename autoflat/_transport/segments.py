"""Elementwise operations on packed leaves, run once on the packed buffer.

A packed state reaches the step as a few 1-D buffers; the step's code works leaf by leaf. An
optimizer's update applies the same elementwise operation to every leaf (`m * 0.9 + g * 0.1`
for each of a thousand moments), and cutting each leaf out of its buffer, updating it and
concatenating it back costs compile time per leaf (docs/performance.md, "Packed transport").
`Interpreter.eval` evaluates the step's jaxpr (traced leaf by leaf, as written: `_entry`)
with the leaves of a packed buffer as *views*, segments of a buffer not yet cut. An
elementwise operation whose array operands are views of aligned segments (same shapes,
segment by segment) is recorded once for the whole run of aligned segments, not per leaf;
the per-leaf operands it meets (gradients computed leaf by leaf) are concatenated into a
buffer of the same segments. Nothing is computed until it is needed:

- an operation that is not elementwise (a matmul, a reduction) gets its leaves cut out and
  computed leaf by leaf, each from the leaves it depends on: the program the flat transport
  compiles for that leaf;
- a packed output whose leaves are runs of one whole computation is that computation's buffer
  (or a slice of it), computed once for all of them;
- a `num_steps` scan whose carry holds every leaf of a packed buffer carries the buffer
  instead, and its body is evaluated with views of it the same way (`_scan`; on JAX 0.10,
  whose scan this reads; other scans cut their carry out leaf by leaf).

Elementwise means that element i of the result depends on element i of each operand only,
with no parameter naming a shape or a position (`_ELEMENTWISE`); then computing a segment
inside the whole buffer gives the same values as computing it alone. XLA simplifies a
whole-buffer computation otherwise than a per-leaf one (`a / b / c` into `a / (b * c)` in
one, not the other), so results can differ in the last bits from the flat transport's.
Everything else runs as traced.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from .wholes import Buffer, Gathered, Op, View, Whole, leaf, pack_group

# Primitives whose result element i depends only on element i of each operand (or on scalar
# operands), with no parameter that names a shape, an axis or a position.
_ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
        "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh",
        "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
        "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p", "logistic",
        "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow",
        "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh",
        "sqrt", "square", "sub", "tan", "tanh", "xor",
    }
)  # fmt: skip


class _Same:
    """An object compared by identity (a tracer in a memo key)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def _scalar_key(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return _Same(x)
    a = np.asarray(x)
    return (a.dtype.str, a.tobytes())


class Interpreter:
    """Evaluates jaxprs with views (see the module doc); one per traced step."""

    def __init__(self) -> None:
        # (primitive, params, operand keys) -> the whole operations recorded for it
        self.memo: dict[Any, list[tuple[Op, list[Gathered]]]] = {}
        # (whole, other whole, shift) -> per segment of the first, where its aligned run starts
        # and ends
        self.runs: dict[Any, tuple[list[int], list[int]]] = {}

    def eval(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = None
            if any(type(x) is View for x in invals):
                if eqn.primitive.name in _ELEMENTWISE:
                    out = self._elementwise(eqn, invals)
                    outs = None if out is None else [out]
                elif _inlinable(eqn):
                    inner = eqn.params["jaxpr"]
                    if isinstance(inner, ClosedJaxpr):
                        outs = self.eval(inner.jaxpr, inner.consts, invals)
                    else:
                        outs = self.eval(inner, (), invals)
                elif eqn.primitive.name == "scan":
                    outs = _scan(eqn, invals)
            if outs is None:
                invals = [x.leaf() if type(x) is View else x for x in invals]
                bound = eqn.primitive.get_bind_params(eqn.params)
                # (JAX 0.4 gives (subfunctions, params), later JAX the params alone)
                subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*subfuns, *invals, **params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        # (a literal result, such as a constant flag kept in the state, as the array it is)
        return [
            jax.numpy.asarray(v.val, v.aval.dtype)  # type: ignore[attr-defined]
            if isinstance(v, Literal)
            else env[v]
            for v in jaxpr.outvars
        ]

    def _elementwise(self, eqn: Any, invals: list[Any]) -> View | None:
        shape = tuple(eqn.outvars[0].aval.shape)
        if not shape:
            return None  # a scalar leaf: a scalar operand could be its own or shared
        try:
            params = tuple(sorted(eqn.params.items()))
            hash(params)
        except TypeError:
            return None
        if eqn.params.get("sharding") is not None:
            return None
        base = next(x for x in invals if type(x) is View)
        t = base.t
        keys: list[Any] = []
        for x in invals:
            if type(x) is View:
                if tuple(x.whole.shapes[x.t]) != shape:
                    return None
                keys.append((_Same(x.whole), x.t - t))
            elif not np.shape(x):
                keys.append(("scalar", _scalar_key(x)))
            elif tuple(np.shape(x)) == shape:
                keys.append("leaf")
            else:
                return None
        key = (eqn.primitive, params, tuple(keys))
        for op, gathered in self.memo.get(key, ()):
            if op.lo <= t < op.hi and all(t not in g.parts for g in gathered):
                break
        else:
            op, gathered = self._record(eqn, invals, base, params)
            self.memo.setdefault(key, []).append((op, gathered))
        it = iter(gathered)
        for x in invals:
            if type(x) is not View and np.shape(x):
                next(it).parts[t] = x
        return View(op, t)

    def _record(
        self, eqn: Any, invals: list[Any], base: View, params: tuple[Any, ...]
    ) -> tuple[Op, list[Gathered]]:
        """A whole operation for `eqn` over the run of segments aligned around base's."""
        t, w = base.t, base.whole
        lo, hi = max(w.lo, 0), w.hi
        for x in invals:
            if type(x) is View:
                a, b = self._aligned(w, x.whole, x.t - t)
                lo, hi = max(lo, a[t]), min(hi, b[t])
        operands: list[Any] = []
        gathered = []
        for x in invals:
            if type(x) is View:
                operands.append((x.whole, x.t - t))
            elif np.shape(x):
                g = Gathered(w, lo, hi)
                g.dtype = x.dtype
                gathered.append(g)
                operands.append(g)
            else:
                operands.append(x)
        dtype = eqn.outvars[0].aval.dtype
        return Op(eqn.primitive, dict(params), operands, w, lo, hi, dtype), gathered

    def _aligned(self, w: Whole, other: Whole, shift: int) -> tuple[list[int], list[int]]:
        """Per segment t of w: the run of segments around it where segment t + shift of
        `other` is valid and of the same shape (start, end)."""
        key = (_Same(w), _Same(other), shift)
        if key not in self.runs:
            n = len(w.shapes)
            ok = [
                other.lo <= s + shift < other.hi and w.shapes[s] == other.shapes[s + shift]
                for s in range(n)
            ]
            starts, ends = [0] * n, [0] * n
            start = 0
            for s in range(n):
                if not ok[s]:
                    start = s + 1
                starts[s] = start
            end = n
            for s in reversed(range(n)):
                if not ok[s]:
                    end = s
                ends[s] = end
            self.runs[key] = (starts, ends)
        return self.runs[key]


def _inlinable(eqn: Any) -> bool:
    """A nested `jax.jit` with nothing but its function: evaluated in place."""
    if eqn.primitive.name not in ("jit", "pjit") or eqn.effects:
        return False
    params = eqn.params
    jaxpr = params.get("jaxpr")
    closed = isinstance(jaxpr, ClosedJaxpr) or (isinstance(jaxpr, Jaxpr) and not jaxpr.constvars)
    if not closed or params.get("compiler_options_kvs"):
        return False
    shardings = tuple(params.get("in_shardings", ())) + tuple(params.get("out_shardings", ()))
    return all(type(s).__name__ == "UnspecifiedValue" for s in shardings)


_SCAN_PARAMS = {"num_consts", "num_carry", "jaxpr", "length", "reverse", "unroll"}


@functools.cache
def scans_with_views() -> bool:
    """Whether this JAX's scan is one `_scan` runs with views (JAX 0.10's, not 0.12's)."""
    jaxpr = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c, c), c, length=1))(0.0)
    return _SCAN_PARAMS <= jaxpr.eqns[0].params.keys()


def _scan(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """A `lax.scan` (the `num_steps` loop) whose carry holds every leaf of packed buffers:
    run again carrying those buffers, its body evaluated with views of them; None if it
    carries no whole buffer."""
    p = eqn.params
    if not _SCAN_PARAMS <= p.keys() or not isinstance(p["jaxpr"], ClosedJaxpr):
        return None  # JAX 0.12's scan describes its operands otherwise: it runs as traced
    nc, nk = p["num_consts"], p["num_carry"]
    init = invals[nc : nc + nk]
    found: dict[Buffer, dict[int, int]] = {}
    for pos, x in enumerate(init):
        if type(x) is View and type(x.whole) is Buffer:
            found.setdefault(x.whole, {}).setdefault(x.t, pos)
    buffers = [w for w, at in found.items() if len(at) == len(w.shapes)]
    if not buffers:
        return None
    place = {found[w][t]: (i, t) for i, w in enumerate(buffers) for t in range(len(w.shapes))}
    rest = [pos for pos in range(nk) if pos not in place]
    consts = [leaf(x) for x in invals[:nc]]
    body = p["jaxpr"]

    def carried(bufs: list[Any], others: list[Any]) -> list[Any]:
        wholes = [Buffer(w.group, b) for w, b in zip(buffers, bufs, strict=True)]
        values: list[Any] = [None] * nk
        for pos, x in zip(rest, others, strict=True):
            values[pos] = x
        for pos, (i, t) in place.items():
            values[pos] = View(wholes[i], t)
        return values

    def step(carry: Any, x: Any) -> Any:
        values = carried(*carry)
        outs = Interpreter().eval(body.jaxpr, body.consts, [*consts, *values, *x])
        new = outs[:nk]
        bufs = [
            pack_group(w.group, [new[found[w][t]] for t in range(len(w.shapes))]) for w in buffers
        ]
        return (bufs, [leaf(new[pos]) for pos in rest]), [leaf(y) for y in outs[nk:]]

    init_carry = ([w.buffer for w in buffers], [leaf(init[pos]) for pos in rest])
    (bufs, others), ys = jax.lax.scan(
        step,
        init_carry,
        [leaf(x) for x in invals[nc + nk :]],
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carried(bufs, others), *ys]
