"""One step evaluated abstractly, and abstract values compared: what state matching reads.

- **One step's abstract output** (`eval_one_step`): the step traced under `jax.eval_shape` (no
  compile) with each argument as its role gives it: static ones as they are, per-step ones
  without their leading axis (with one step a call, as they are, Python numbers traced as
  `jax.jit` traces them), the rest as ShapeDtypeStructs. Only traced values leave the
  evaluation, so a Python value the step returns unchanged stays one; a traced value returned
  at two places is one abstract value at both (`is_copy`), and a returned dict keeps the
  step's own key order. `positions_of` splits it into its return positions.
- **Abstract values compared** (`same_value`): the same tree structure, and per leaf the same
  shape and dtype as JAX computes with it (NumPy float64 is float32 without x64), the same
  static value, or a Python scalar that comes back as a 0-d array.
- **One step's abstract output served** (`one_step_from`): while a first call's inference
  runs, the runtime may give `eval_one_step` what it asks for from a trace it makes anyway
  (the program of the roles the source and the arguments' types give, traced for the call
  under the step's own `jax.jit`, whose trace JAX then reuses): the same step traced with the
  same abstract arguments, read off as `eval_one_step` reads it (`abstract_return`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _jax
from .._handles import writeback as _writeback
from .._handles.lazy import LazyHandle
from .._transport.structure import computed_dtype, is_array, is_explicit
from .options import Role

SCALARS = (bool, int, float, complex)


def abstract_leaves(value: Any, drop_axis: bool, scalars: bool = False) -> tuple[Any, list[Any]]:
    """(rebuild, abstract array leaves) of a value: arrays become ShapeDtypeStructs, and with
    `scalars` Python numbers too (weakly typed, as `jax.jit` traces a per-step one); weakly
    typed arrays stay weakly typed, as `jax.jit` traces them."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    treedef_: Any = treedef
    positions = [
        i for i, x in enumerate(leaves) if is_array(x) or (scalars and isinstance(x, SCALARS))
    ]
    abstract = [
        jax.ShapeDtypeStruct(
            np.shape(leaves[i])[1:] if drop_axis else np.shape(leaves[i]),
            jax.numpy.result_type(leaves[i]),
            weak_type=isinstance(leaves[i], SCALARS) or bool(_jax.weak_type(leaves[i])),
            sharding=_explicit_sharding(leaves[i], drop_axis),
        )
        for i in positions
    ]

    def rebuild(arrays: list[Any]) -> Any:
        full = list(leaves)
        for i, a in zip(positions, arrays, strict=True):
            full[i] = a
        return treedef_.unflatten(full)

    return rebuild, abstract


def _explicit_sharding(x: Any, drop_axis: bool) -> Any:
    """The sharding of an array on a mesh with explicit axes, which the step may read
    (`jax.typeof(x).sharding`, `with_sharding_constraint` asserting it), as one step sees it;
    None for any other array (its sharding is not part of its type)."""
    sharding: Any = getattr(x, "sharding", None)
    if not is_explicit(sharding):
        return None
    if drop_axis:
        spec = tuple(sharding.spec)
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
    return sharding


def _keyword_only(fn: Callable[..., Any]) -> frozenset[str]:
    """The names of `fn`'s keyword-only parameters (after `*`): passed by name."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _one_step_call(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    scalars: frozenset[str] = frozenset(),
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Per parameter (rebuild, abstract leaves), or (None, value) for a static one, and a
    function calling `fn` with one value per parameter (keyword-only ones by name).
    `scalars`: parameters whose Python numbers are traced too (unless static)."""
    parts: list[Any] = []
    for p in params:
        role = roles[p]
        if role == "static":
            parts.append((None, values[p]))
        else:
            # A per-step input with one step a call goes into `jax.jit` as it is: its Python
            # numbers are traced.
            scanned = role == "scanned"
            parts.append(
                abstract_leaves(
                    values[p],
                    scanned and num_steps > 1,
                    p in scalars or (scanned and num_steps == 1),
                )
            )
    keyword_only = _keyword_only(fn)

    def call(args: list[Any]) -> Any:
        positional = [a for p, a in zip(params, args, strict=True) if p not in keyword_only]
        named = {p: a for p, a in zip(params, args, strict=True) if p in keyword_only}
        with _writeback.untouched(params, args, None):  # no traced value left in your objects
            return fn(*positional, **named)

    return parts, call


def _arguments(parts: list[Any], arrays: list[list[Any]]) -> list[Any]:
    """One value per parameter: rebuilt from its (abstract) arrays, or a static one as is."""
    return [
        value if rebuild is None else rebuild(a)
        for (rebuild, value), a in zip(parts, arrays, strict=True)
    ]


class Flow(NamedTuple):
    """Where one return position's arrays come from (`flows`): the parameters they are
    computed from, those whose own arrays are operands of the last operation making them,
    and per leaf (in `tree_leaves` order) the parameters that leaf is computed from and the
    parameter it is an own leaf of, given back as it came (`x` in `(h, x)`), or None."""

    sources: frozenset[str]
    direct: frozenset[str]
    leaves: tuple[frozenset[str], ...]
    owners: tuple[str | None, ...]  # per leaf, the parameter it is the own leaf of


# The operations that accumulate, their first operand the running value (`flows_traced`,
# `flows(additions=True)`).
ADDITIONS = frozenset({"add", "sub", "add_any"})
SUMS = frozenset({"add", "add_any"})  # (away from a number's place: `target - ent` is no sum)


def flows(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    split: Callable[[Any], list[Any]],
    additions: bool = False,
) -> list[Flow]:
    """For each return position (`split` of one step's value), its `Flow`: the parameters
    its arrays are computed from, and those whose own arrays are operands of the last
    operation making them (`p + u`; with `additions`, only where that operation is an
    addition), read off the step's jaxpr. Computed-from is an over-approximation: every
    output of an operation counts as computed from all of its inputs."""
    last = ADDITIONS if additions else None
    attempt = functools.partial(_flows, fn, params, values, roles, num_steps, split, last=last)
    return _traced_on_failure(attempt, values, roles)


def flows_traced(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    split: Callable[[Any], list[Any]],
    numbers: frozenset[str],
    last: frozenset[str] = ADDITIONS,
) -> list[Flow] | None:
    """`flows`, with the parameters `numbers` (Python numbers, static with num_steps > 1)
    traced as `jax.jit` traces them, and only additions (`total + loss`, `total - x`; or
    the operations `last`) counted as the last operation taking a parameter's own leaf (a
    product, `loss * scale`, is not an accumulation); None if the step needs one of them
    concrete."""
    roles = {**roles, **dict.fromkeys(numbers, "broadcast")}
    try:
        return _flows(fn, params, values, roles, num_steps, split, numbers, last)
    except Exception:
        return None


def _flows(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    split: Callable[[Any], list[Any]],
    scalars: frozenset[str],
    last: frozenset[str] | None = None,
) -> list[Flow]:
    """`flows` once, with the Python numbers of the parameters `scalars` traced (and, given
    `last`, only operations of those names counted as the last one taking an operand)."""
    parts, call = _one_step_call(fn, params, values, roles, num_steps, scalars)
    kinds: list[list[bool]] = []  # per position, per leaf: traced (else a constant)

    def one_step(arrays: list[list[Any]]) -> Any:
        args = _arguments(parts, arrays)
        outs = []
        for item in split(call(args)):
            leaves = jax.tree_util.tree_leaves(item)
            kinds.append([_jax.is_tracer(x) for x in leaves])
            outs += [x for x in leaves if _jax.is_tracer(x)]
        return outs

    inputs = [[] if rebuild is None else a for rebuild, a in parts]
    jaxpr = jax.make_jaxpr(one_step)(inputs).jaxpr
    owners = [p for p, a in zip(params, inputs, strict=True) for _ in a]
    sources, direct, roots = _walk(jaxpr, [frozenset({p}) for p in owners], list(owners), last)
    result = []
    at = 0
    for traced in kinds:
        span = range(at, at + sum(traced))
        at += len(span)
        index = iter(span)
        at_leaf = [next(index) if t else None for t in traced]
        result.append(
            Flow(
                _NONE.union(*(sources[i] for i in span)),
                _NONE.union(*(direct[i] | _own(roots[i]) for i in span)),
                tuple(_NONE if i is None else sources[i] for i in at_leaf),
                tuple(None if i is None else roots[i] for i in at_leaf),
            )
        )
    return result


def _traced_on_failure(
    evaluate: Callable[[frozenset[str]], Any], values: dict[str, Any], roles: dict[str, Role]
) -> Any:
    """`evaluate(frozenset())`, which keeps the Python numbers inside state and broadcast
    arguments as they are (so that a counter given back unchanged stays one); if the step
    raises on them (`1.0 / state.step` at step 0, a ZeroDivisionError where `jax.jit` traces
    the 0 and computes inf), again with the numbers of one argument traced, as `jax.jit`
    traces them, for each such argument in turn (another's may be needed concrete: a config
    of layer sizes), then of all. If every try raises, the first error is the step's own."""
    try:
        return evaluate(frozenset())
    except Exception as first:
        holding = [
            p
            for p, value in values.items()
            if roles[p] != "static"
            and any(isinstance(x, SCALARS) for x in jax.tree_util.tree_leaves(value))
        ]
        tries = [frozenset({p}) for p in holding]
        if len(holding) > 1:
            tries.append(frozenset(holding))
        for traced in tries:
            try:
                return evaluate(traced)
            except Exception:
                continue
        raise first from None


_NONE: frozenset[str] = frozenset()


def _own(root: str | None) -> frozenset[str]:
    return _NONE if root is None else frozenset({root})


def _walk(
    jaxpr: Any,
    sources_in: list[frozenset[str]],
    roots_in: list[str | None],
    last: frozenset[str] | None = None,
) -> tuple[list[frozenset[str]], list[frozenset[str]], list[str | None]]:
    """Per output of `jaxpr`, given per input the parameters it is computed from and the
    parameter it is the own leaf of (or None): the parameters it is computed from (every
    output of an operation counts as computed from all of its inputs), those whose own leaves
    are operands of the operation making it (`p + u` in `optax.apply_updates`), and the
    parameter it is the own leaf of, through casts and reshapes. A call of a jaxpr (a
    `jax.jit`-ed helper, a custom derivative, a remat) is walked into; another operation
    holding jaxprs (a scan, a cond) takes no operand directly; given `last` (additions),
    only an operation of those names does, and only its first operand."""
    source: dict[Any, frozenset[str]] = dict(zip(_jax.inputs(jaxpr), sources_in, strict=True))
    root: dict[Any, str] = {
        v: r for v, r in zip(_jax.inputs(jaxpr), roots_in, strict=True) if r is not None
    }
    direct: dict[Any, frozenset[str]] = {}

    def get(v: Any) -> tuple[frozenset[str], str | None]:
        if _jax.is_literal(v):
            return _NONE, None
        return source.get(v, _NONE), root.get(v)

    for eqn in _jax.equations(jaxpr):
        ins = [v for v in _jax.inputs(eqn) if not _jax.is_literal(v)]
        inner = _jax.called_jaxpr(eqn)
        if inner is not None:
            got = [get(v) for v in _jax.inputs(eqn)]
            walked = _walk(inner, [g[0] for g in got], [g[1] for g in got], last)
            for v, s_, d_, r_ in zip(_jax.outputs(eqn), *walked, strict=True):
                source[v], direct[v] = s_, d_
                if r_ is not None:
                    root[v] = r_
            continue
        found = _NONE.union(*(source.get(v, _NONE) for v in ins))
        holds = _jax.holds_jaxprs(eqn)
        if last is None:
            operands = [] if holds else ins
        else:
            # An accumulation's own value is its first operand (`total + loss`, `t - 1`):
            # `loss + beta` and `loss - f_star` do not accumulate `beta` or `f_star`.
            first = list(_jax.inputs(eqn)[:1])
            takes = _jax.name(eqn) in last and first and not _jax.is_literal(first[0])
            operands = first if takes else []
        near = frozenset(root[v] for v in operands if v in root)
        through = _jax.name(eqn) in _PASS_THROUGH and len(ins) == 1 and ins[0] in root
        for v in _jax.outputs(eqn):
            source[v] = found
            direct[v] = near
            if through:
                root[v] = root[ins[0]]
    got_out = [get(v) for v in _jax.outputs(jaxpr)]
    return (
        [s_ for s_, _ in got_out],
        [_NONE if _jax.is_literal(v) else direct.get(v, _NONE) for v in _jax.outputs(jaxpr)],
        [r_ for _, r_ in got_out],
    )


# Operations that pass a value through (a cast, a copy, a reshape): what they make is still
# the parameter's own leaf for `flows`.
_PASS_THROUGH = frozenset(
    {"convert_element_type", "copy", "copy_p", "reshape", "squeeze", "expand_dims"}
)


# What serves `eval_one_step` while a first call's inference runs (`one_step_from`): called
# with (fn, values, roles, num_steps), it gives `(abstract output,)`, or None to let
# `eval_one_step` evaluate.
Server = Callable[[Callable[..., Any], dict[str, Any], dict[str, Role], int], tuple[Any] | None]
_SERVER: contextvars.ContextVar[Server | None] = contextvars.ContextVar(
    "autoflat_one_step", default=None
)


@contextlib.contextmanager
def one_step_from(server: Server | None) -> Iterator[None]:
    """Within this context, `eval_one_step` (without `after`) asks `server` first."""
    token = _SERVER.set(server)
    try:
        yield
    finally:
        _SERVER.reset(token)


def abstract_return(value: Any) -> Any:
    """A step's return value, taken inside a trace, as `eval_one_step` gives it: each traced
    leaf an abstract value (one per distinct traced value: `is_copy`), every other leaf as it
    is, a dict in the step's own key order."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    distinct: dict[int, Any] = {}
    out = []
    for x in leaves:
        if _jax.is_tracer(x):
            if id(x) not in distinct:
                distinct[id(x)] = jax.ShapeDtypeStruct(
                    x.shape, x.dtype, weak_type=bool(_jax.weak_type(x))
                )
            x = distinct[id(x)]
        out.append(x)
    result = jax.tree_util.tree_unflatten(treedef, out)
    return {k: result[k] for k in value} if type(value) is dict else result


def eval_one_step(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    after: dict[str, Any] | None = None,
) -> Any:
    """The abstract value one step returns, for these arguments. With `after`, its keys are
    parameters whose leaves after the step (updated in place: state written back) are put
    there as (key path, leaf) pairs, abstract where traced. The Python numbers inside state
    and broadcast arguments stay Python numbers, unless the step raises on them
    (`_traced_on_failure`). Served by the runtime's trace where it can (`one_step_from`)."""
    server = _SERVER.get()
    if server is not None and after is None:
        served = server(fn, values, roles, num_steps)
        if served is not None:
            return served[0]

    def attempt(scalars: frozenset[str]) -> Any:
        parts, call = _one_step_call(fn, params, values, roles, num_steps, scalars)
        found: dict[str, Any] = {}

        def one_step(arrays: list[list[Any]]) -> Any:
            args = _arguments(parts, arrays)
            # Only traced values leave the evaluation; the rest (Python values, constants) are
            # kept as they are, so a Python scalar returned unchanged stays one.
            result = call(args)
            leaves, treedef = jax.tree_util.tree_flatten(result)
            found["treedef"] = treedef
            # A returned dict's keys in the step's own order (flattening sorts them): its
            # items are return positions in that order (`{"params": p, "log": p}`).
            found["order"] = tuple(result) if type(result) is dict else None
            found["n"] = len(leaves)
            found["lengths"] = []
            found["paths"] = []
            for p in after or ():
                pairs = jax.tree_util.tree_leaves_with_path(args[params.index(p)])
                paths = [path for path, _ in pairs]
                changed = [x for _, x in pairs]
                found["lengths"].append(len(changed))
                found["paths"].append(paths)
                leaves += changed
            found["leaves"] = leaves
            # Per leaf, the index of its traced value among the distinct ones (-1: not
            # traced): a value returned twice (`return {"params": p, "log": p}`) comes out as
            # one abstract value at both places (`is_copy`).
            distinct: dict[int, int] = {}
            outs: list[Any] = []
            for x in leaves:
                if _jax.is_tracer(x) and id(x) not in distinct:
                    distinct[id(x)] = len(outs)
                    outs.append(x)
            found["index"] = [distinct.get(id(x), -1) if _jax.is_tracer(x) else -1 for x in leaves]
            return outs

        abstract = jax.eval_shape(one_step, [[] if r is None else a for r, a in parts])
        leaves = [
            abstract[i] if i >= 0 else x
            for x, i in zip(found["leaves"], found["index"], strict=True)
        ]
        n = found["n"]
        if after is not None:
            start = n
            for p, count, paths in zip(after, found["lengths"], found["paths"], strict=True):
                after[p] = list(zip(paths, leaves[start : start + count], strict=True))
                start += count
        out = found["treedef"].unflatten(leaves[:n])
        order = found["order"]
        return out if order is None else {k: out[k] for k in order}

    return _traced_on_failure(attempt, values, roles)


def is_copy(earlier: Any, later: Any) -> bool:
    """Whether two return positions of one step's abstract value (`eval_one_step`) give back
    the very same traced values (`return p, p`, `{"params": p, "log": p}`), not values alike."""
    leaves, treedef = jax.tree_util.tree_flatten(earlier)
    others, other_treedef = jax.tree_util.tree_flatten(later)
    same: bool = treedef == other_treedef  # type: ignore[operator]
    return (
        same
        and any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        and all(a is b for a, b in zip(leaves, others, strict=True))
    )


def positions_of(first: Any, out: Any) -> list[Any]:
    if first is None or first.kind == "none":
        return []
    if first.kind == "single":
        return [out]
    if first.keys:
        keys = first.keys
        return [out[k] for k in keys] if isinstance(out, dict) and set(out) == set(keys) else []
    return list(out) if isinstance(out, tuple) and len(out) == len(first.names) else []


_MARK = object()  # a placeholder leaf


def _signature(value: Any) -> tuple[Any, tuple[Any, ...]]:
    """(tree structure, per leaf: shape and dtype, "scalar" or the static value). A lazy
    handle counts as the object it stands for (its own pytree node holds that object's tree:
    unflattened, it is that object)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if any(
        type(x) is LazyHandle
        for x in jax.tree_util.tree_leaves(value, is_leaf=lambda y: type(y) is LazyHandle)
    ):
        rebuilt = jax.tree_util.tree_unflatten(treedef, [_MARK] * len(leaves))
        treedef = jax.tree_util.tree_structure(rebuilt)
    sig: list[Any] = []
    for x in leaves:
        if is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
            sig.append((tuple(np.shape(x)), computed_dtype(x.dtype)))
        elif isinstance(x, SCALARS):
            sig.append("scalar")
        else:
            sig.append(("static", _static(x)))
    return treedef, tuple(sig)


def _promoted(a: Any, b: Any) -> bool:
    """Two leaf signatures of one shape, the second's dtype what the first's promotes to
    when weakly typed."""
    if not (isinstance(a, tuple) and isinstance(b, tuple)) or "static" in (a[0], b[0]):
        return False
    (shape_a, dtype_a), (shape_b, dtype_b) = a, b
    if shape_a != shape_b:
        return False
    weak = jax.ShapeDtypeStruct(shape_a, dtype_a, weak_type=True)
    try:
        promoted = jax.numpy.result_type(weak, jax.ShapeDtypeStruct(shape_b, dtype_b))
    except (TypeError, ValueError):
        return False  # (a PRNG key's dtype takes no part in type promotion)
    return bool(promoted == dtype_b)


def _static(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return id(x)


def same_value(arg: Any, out: Any, promote: bool = False) -> bool:
    """Whether `out` could be the new value of `arg` as a `lax.scan` carry: the same tree
    structure, shapes and dtypes; with `promote`, also where a weakly typed leaf of `arg`
    (made from a Python number) comes back promoted (a counter `jnp.asarray(0)` summing
    float32 rewards), as `lax.scan` promotes a carry (`_Inference._match_promoted` asks for
    more evidence then)."""
    (t1, s1), (t2, s2) = _signature(arg), _signature(out)
    if t1 != t2:
        return False
    weak: list[bool] | None = None
    for i, (a, b) in enumerate(zip(s1, s2, strict=True)):
        if a == b:
            continue
        if promote and _promoted(a, b):
            if weak is None:
                weak = [bool(_jax.weak_type(x)) for x in jax.tree_util.tree_leaves(arg)]
            if weak[i]:
                continue
        scalar_like = {a, b} - {"scalar"}
        if "scalar" in (a, b) and len(scalar_like) == 1:
            other = scalar_like.pop()
            if isinstance(other, tuple) and len(other) == 2 and other[0] == ():
                continue  # a Python scalar that comes back as a 0-d array
        return False
    return True
