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
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .. import _jax
from .._analysis.returns import unnest
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


def _kinds(fn: Callable[..., Any]) -> dict[str, Any]:
    """The kind of each of `fn`'s parameters (`inspect.Parameter.KEYWORD_ONLY`, ...)."""
    try:
        return {p.name: p.kind for p in inspect.signature(fn).parameters.values()}
    except (TypeError, ValueError):
        return {}


def _passing(fn: Callable[..., Any], params: tuple[str, ...]) -> Callable[[list[Any]], Any]:
    """A function calling `fn` with one value per parameter, as Python bound them: a
    keyword-only one by name, `*args`' tuple and `**kwargs`' dict spread."""
    kinds = _kinds(fn)
    P = inspect.Parameter
    if all(kinds.get(p) in (None, P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) for p in params):
        return lambda args: fn(*args)

    def call(args: list[Any]) -> Any:
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for p, a in zip(params, args, strict=True):
            kind = kinds.get(p)
            if kind is P.VAR_POSITIONAL:
                positional.extend(a)
            elif kind is P.KEYWORD_ONLY:
                named[p] = a
            elif kind is P.VAR_KEYWORD:
                named.update(a)
            else:
                positional.append(a)
        return fn(*positional, **named)

    return call


def one_step_call(
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
    passing = _passing(fn, params)

    def call(args: list[Any]) -> Any:
        with _writeback.untouched(params, args, None):  # no traced value left in your objects
            return passing(args)

    return parts, call


def arguments(parts: list[Any], arrays: list[list[Any]]) -> list[Any]:
    """One value per parameter: rebuilt from its (abstract) arrays, or a static one as is."""
    return [
        value if rebuild is None else rebuild(a)
        for (rebuild, value), a in zip(parts, arrays, strict=True)
    ]


def changes_inside(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    roles: dict[str, Role],
    num_steps: int,
    p: str,
) -> bool:
    """Whether one step of `fn` changes a leaf of argument `p` in place (a Flax NNX object
    inside it whose Variables it sets: `optimizer.update(...)`), by an abstract evaluation:
    after the body, `p`'s value as the body holds it has another leaf than it was built
    from."""
    parts, call = one_step_call(fn, params, values, roles, num_steps)
    i = params.index(p)
    changed: list[bool] = []

    def one_step(arrays: list[list[Any]]) -> int:
        args = arguments(parts, arrays)
        before = jax.tree_util.tree_leaves(args[i])
        call(args)
        after = jax.tree_util.tree_leaves(args[i])
        changed.append(len(before) != len(after) or any(map(operator.is_not, before, after)))
        return 0

    jax.eval_shape(one_step, [[] if r is None else a for r, a in parts])
    return changed[0]


def traced_on_failure(
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
    (`traced_on_failure`). Served by the runtime's trace where it can (`one_step_from`)."""
    server = _SERVER.get()
    if server is not None and after is None:
        served = server(fn, values, roles, num_steps)
        if served is not None:
            return served[0]

    def attempt(scalars: frozenset[str]) -> Any:
        parts, call = one_step_call(fn, params, values, roles, num_steps, scalars)
        found: dict[str, Any] = {}

        def one_step(arrays: list[list[Any]]) -> Any:
            args = arguments(parts, arrays)
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

    return traced_on_failure(attempt, values, roles)


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
    items = unnest(first.nest, out)
    return items if items is not None and len(items) == len(first.names) else []


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
    # A weakly typed value promotes as the Python number of its kind does (`result_type`
    # does not read a ShapeDtypeStruct's weak type): a weak float32 with bfloat16 gives
    # bfloat16, as `0.9 * ema + 0.1 * loss` does under `jax.jit`.
    number = _python_kind(dtype_a) if _plain_dtype(dtype_a) else None
    if number is None:
        return False  # (a PRNG key's dtype takes no part in type promotion)
    try:
        promoted = jax.numpy.result_type(number, dtype_b)
    except (TypeError, ValueError):
        return False
    return bool(promoted == dtype_b)


def _python_kind(dtype: Any) -> type | None:
    """The Python number type a weakly typed value of `dtype` promotes as."""
    for kind, number in _PYTHON_KINDS:
        if jax.numpy.issubdtype(dtype, kind):
            return number
    return None


_PYTHON_KINDS = (
    (jax.numpy.bool_, bool),
    (jax.numpy.integer, int),
    (jax.numpy.floating, float),
    (jax.numpy.complexfloating, complex),
)


def narrowed(arg: Any, out: Any) -> bool:
    """Whether a weakly typed float leaf of `arg` comes back in `out` (the same tree) as a
    narrower float (float32 as bfloat16): promoted so under `jax.jit`, and weaker evidence
    of being `arg`'s new value than a widening (int to float)."""
    (_, s1), (_, s2) = _signature(arg), _signature(out)
    return any(
        isinstance(a, tuple)
        and isinstance(b, tuple)
        and isinstance(a[0], tuple)  # (shape, dtype), not ("static", value)
        and isinstance(b[0], tuple)
        and a != b
        and _plain_dtype(a[1])
        and _plain_dtype(b[1])
        and jax.numpy.issubdtype(a[1], jax.numpy.floating)
        and jax.numpy.issubdtype(b[1], jax.numpy.floating)
        and np.dtype(b[1]).itemsize < np.dtype(a[1]).itemsize
        for a, b in zip(s1, s2, strict=True)
    )


def _plain_dtype(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


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
    float32 rewards), as `lax.scan` promotes a carry (`Inference.match_promoted` asks for
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
