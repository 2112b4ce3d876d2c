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
  instead, and its body is evaluated with views of it the same way (`_scan`; on JAX 0.4 and
  0.10, whose scan this reads; other scans cut their carry out leaf by leaf).

The equations on views that run leaf by leaf are counted (`Interpreter.leaf_by_leaf`, at each
trace; `autoflat.stats(step).leaf_by_leaf`), so a step that loses the whole-buffer evaluation
shows it. Jaxprs are read through `autoflat._jax`.

Elementwise means that element i of the result depends on element i of each operand only,
with no parameter naming a shape or a position (`_ELEMENTWISE`); then computing a segment
inside the whole buffer gives the same values as computing it alone. XLA simplifies a
whole-buffer computation otherwise than a per-leaf one (`a / b / c` into `a / (b * c)` in
one, not the other), so results can differ in the last bits from the flat transport's.
Everything else runs as traced: an equation with no view among its operands is copied into
the program's jaxpr as it is (`_jax.emit`: no abstract evaluation again, so a packed step
costs little more to trace than a flat one), or bound again where it cannot be copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax
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
    if _jax.is_tracer(x):
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
        # equations on views computed leaf by leaf, their operands cut out (`Stats`)
        self.leaf_by_leaf = 0

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """The outputs of an open jaxpr on `consts` and `args`, which may be views."""
        env: dict[Any, Any] = {}
        for v, x in zip(_jax.const_inputs(jaxpr), consts, strict=True):
            env[v] = x
        for v, x in zip(_jax.inputs(jaxpr), args, strict=True):
            env[v] = x
        for eqn in _jax.equations(jaxpr):
            outs = _jax.emit(eqn, env)
            if outs is not None:
                for v, x in zip(_jax.outputs(eqn), outs, strict=True):
                    env[v] = x
                continue
            invals = [_jax.value_of(env, v) for v in _jax.inputs(eqn)]
            outs = None
            if any(type(x) is View for x in invals):
                outs = self._with_views(eqn, invals)
                if outs is None:
                    self.leaf_by_leaf += 1
            if outs is None:
                outs = _jax.bind(eqn, [x.leaf() if type(x) is View else x for x in invals])
            for v, x in zip(_jax.outputs(eqn), outs, strict=True):
                env[v] = x
        # (a literal result, such as a constant flag kept in the state, as the array it is)
        return [
            _jax.literal_array(v) if _jax.is_literal(v) else env[v] for v in _jax.outputs(jaxpr)
        ]

    def _with_views(self, eqn: Any, invals: list[Any]) -> list[Any] | None:
        """An equation's outputs computed on whole buffers (an elementwise operation, a nested
        `jax.jit` evaluated in place, a `num_steps` scan), or None: it runs leaf by leaf."""
        if _jax.name(eqn) in _ELEMENTWISE:
            out = self._elementwise(eqn, invals)
            return None if out is None else [out]
        inner = _jax.inlined(eqn)
        if inner is not None:
            return self.eval(*inner, invals)
        if _jax.name(eqn) == "scan":
            return _scan(self, eqn, invals)
        return None

    def _elementwise(self, eqn: Any, invals: list[Any]) -> View | None:
        shape = tuple(_jax.out_aval(eqn).shape)
        if not shape:
            return None  # a scalar leaf: a scalar operand could be its own or shared
        params = _jax.elementwise_key(eqn)
        if params is None:
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
        key = (_jax.primitive(eqn), params, tuple(keys))
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
        dtype = _jax.out_aval(eqn).dtype
        return Op(_jax.primitive(eqn), dict(params), operands, w, lo, hi, dtype), gathered

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


def scans_with_views() -> bool:
    """Whether this JAX's scan is one `_scan` runs with views (JAX 0.10's, not 0.12's)."""
    return _jax.scans_readable()


def _scan(outer: Interpreter, eqn: Any, invals: list[Any]) -> list[Any] | None:
    """A `lax.scan` (the `num_steps` loop) whose carry holds every leaf of packed buffers:
    run again carrying those buffers, its body evaluated with views of them (what it runs
    leaf by leaf counted in `outer`); None if it carries no whole buffer."""
    p = _jax.scan_params(eqn)
    if p is None:
        return None  # JAX 0.12's scan describes its operands otherwise: it runs as traced
    nc, nk = p.num_consts, p.num_carry
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
    body, body_consts = _jax.opened(p.body)
    counts: list[int] = []  # equations run leaf by leaf, per trace of the body

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
        inner = Interpreter()
        outs = inner.eval(body, body_consts, [*consts, *values, *x])
        counts.append(inner.leaf_by_leaf)
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
        length=p.length,
        reverse=p.reverse,
        unroll=p.unroll,
    )
    outer.leaf_by_leaf += counts[-1]
    return [*carried(bufs, others), *ys]
