"""First-call role inference: what the source leaves open, settled by the first call's values.

The source says which parameters are state when it returns them by name or assigns into them.
At a step's first call (and again for arguments of other types) `infer` settles the rest:

- **Per-step, broadcast or static, by run-time type and shape.** An argument the source and
  options leave open is, with `num_steps=k > 1`: per-step if every array leaf has a leading
  axis of k; broadcast if none has (a reused key, a full batch, a teacher's weights) or if it
  holds values JAX cannot trace (an Equinox module's functions, an optax
  `GradientTransformation`); static if it is a hashable Python scalar or string (as in
  `eqx.filter_jit`). With `num_steps=1` arrays and Python numbers are passed as they are (as
  `jax.jit` passes them); strings are static and objects JAX cannot trace are broadcast.
- **State by abstract value.** One step is evaluated abstractly (`_abstract`: no compile) and
  each return position that does not return a parameter by name is matched to the parameter
  whose abstract value (tree structure, shapes, dtypes) it equals. A container or module
  matches at any position, a bare array only at its own place among the parameters that can
  come back through a return (so a loss is never taken for a scalar input; a PRNG key also
  where nothing else fits). One candidate: state. Several alike: settled by the step's data
  flow (`flows`), then by names, else an error listing them with the `state=` that settles
  it. A parameter named in `state=` that no position matches is an error: never an old value
  carried unchanged. A single `return f(...)` giving a tuple or dict has its items as the
  positions where data flow says state is among them.
- **Python numbers at `num_steps > 1`** are static, unless given back changed at their place
  (a counter `step + 1`): then state, carried as an array.
- **Python numbers at `num_steps=1`** are traced, as `jax.jit` traces them; one the step needs
  concrete (a layer size) fails the abstract evaluation and is made static instead
  (`_scalars`).
- **Python scalars in state that a step changes** (`TrainState.step`, counted up from a
  Python int) become arrays before the first call (`Inferred.to_array`, `_scalars`), so the
  step compiles once, as under `jax.jit`; scalars a step gives back unchanged stay static.

The readings this inference will not choose between (mixed or short leading axes, per-step or
state?) are errors raised by `_hazards`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis, Return
from .._errors import (
    MIXED_ARGUMENT,
    NNX_NOT_PYTREE,
    RAW_KEY_OR_PER_STEP,
    STATE_NOT_MATCHED,
    STATE_POSITION,
    UNHASHABLE_STATIC,
    CallError,
    OptionError,
    ShapeError,
    StateError,
    error,
)
from .._handles.nnx import opaque_module
from .._handles.writeback import is_mutable_module
from .._transport.structure import is_array
from . import matching as _matching
from .abstract import SCALARS, eval_one_step, flows, positions_of, same_value
from .hazards import (
    check_per_step_returned,
    check_state_at,
    check_written_per_step,
    raise_leading_axis_errors,
    refuse_nested_state,
)
from .roles import (
    Options,
    Role,
    Roles,
    RunTime,
    assign_roles,
    named_in_some,
    returned_by_name,
)
from .scalars import scalars_to_array, settle_scalars

_STATIC_SCALARS = (str, bytes, type(None))


@dataclasses.dataclass(frozen=True)
class Inferred:
    """The roles of one kind of call, and the Python scalar leaves of each state argument that
    become arrays (by leaf index, per state position)."""

    roles: Roles
    to_array: tuple[tuple[int, ...], ...]


def arg_kinds(args: tuple[Any, ...], handle_type: type) -> tuple[Any, ...]:
    """What selects the inferred roles of a call: each argument's type (a handle's object's)."""
    return tuple(a.__class__ if type(a) is handle_type else type(a) for a in args)


def infer(
    analysis: Analysis,
    options: Options,
    num_steps: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    may_mutate: bool,
) -> Inferred:
    """The roles of a call with these arguments (see the module doc)."""
    params = analysis.param_names
    returned_at = returned_by_name(analysis, options)
    explicit = (options.static | options.broadcast | options.per_step | {options.instance}) - {None}
    by_source = set(returned_at) | set(analysis.assigned)
    in_place = {p: (spelling, line) for p, spelling, line in analysis.in_place}
    # Dicts and lists changed in place (`d.update(...)`, `xs.append(x)`): state written back
    # into the caller's object, as `d[k] = ...` is.
    changed = {
        p
        for p, a in zip(params, args, strict=True)
        if p in in_place and p not in explicit | by_source and isinstance(a, (dict, list))
    }
    mutable = frozenset(
        p
        for p, a in zip(params, args, strict=True)
        if p in changed or (may_mutate and p not in explicit | by_source and is_mutable_module(a))
    )
    if num_steps > 1:
        check_written_per_step(analysis, options, returned_at, mutable, args, num_steps)
    open_ = [
        p for p in params if p not in explicit | by_source | mutable and p not in options.state
    ]
    values = dict(zip(params, args, strict=True))
    for p in params:
        opaque = None if p in options.static else opaque_module(values[p])
        if opaque is not None:
            path, obj = opaque
            raise error(
                StateError,
                NNX_NOT_PYTREE,
                analysis,
                param=p,
                holds=f"holds at `{p}{path}`" if path else "is",
                cls=obj.__class__.__qualname__,
            )
    for p in options.static:
        try:
            hash(values[p])
        except TypeError:
            raise error(
                CallError, UNHASHABLE_STATIC, analysis, param=p, type=type(values[p]).__name__
            ) from None
    kinds: dict[str, tuple[Role, str]] = {}
    # Errors about an argument's leading axes wait until state is matched by value: a state
    # argument returned under another name may have leaves of any leading axis.
    deferred: dict[str, Exception] = {}
    removed = {p: (spelling, line) for p, spelling, line in analysis.removed}
    defaults = _defaulted(fn, values) if num_steps > 1 else set()
    for p in open_:
        found = _kind(analysis, p, values[p], num_steps)
        if p in defaults and (isinstance(found, Exception) or found[0] == "scanned"):
            # A default the call did not pass (`class_weights=W`) is not per-step data, even
            # if its first axis happens to be num_steps: the same every step, as under jax.jit.
            found = ("broadcast", "its default value, the same every step")
        if isinstance(found, Exception):
            deferred[p] = found
            kinds[p] = ("broadcast", "mixed leading axes")  # a state candidate for now
        elif p in removed and isinstance(values[p], (dict, list)):
            spelling, line = removed[p]
            kinds[p] = (
                found[0],
                f"{found[1]}; `{spelling}` at line {line} changes the step's own copy, as "
                "under jax.jit, not your object",
            )
        else:
            kinds[p] = found
    for p in mutable:
        if p in changed:
            spelling, line = in_place[p]
            why = (
                f"a {values[p].__class__.__name__} changed in place (`{spelling}` at line "
                f"{line}): its new value is written into the caller's object after the call"
            )
        else:
            why = (
                f"{_describe(values[p])} mutated in place: its new Variable values are written "
                "into the caller's object after the call"
            )
        kinds[p] = ("state", why)
    # Each parameter's role for the abstract evaluation (candidates count as broadcast).
    for_eval: dict[str, Role] = {p: kinds[p][0] if p in kinds else "state" for p in params}
    for p in options.static:
        for_eval[p] = "static"
    for p in options.per_step:
        for_eval[p] = "scanned"
    out: Any = None
    if num_steps == 1:
        traced = [p for p in open_ if kinds[p][0] == "scanned" and isinstance(values[p], SCALARS)]
        if traced:
            out = settle_scalars(fn, params, values, for_eval, kinds, traced)

    # State by abstract value: candidates are open broadcast-like arguments and declared state
    # that is neither returned by name nor assigned into.
    declared = {p for p in options.state if p not in by_source | mutable}
    # A method's pytree instance given back changed (`return self.replace(w=w), loss`, the
    # flax.struct agents of jaxrl_m) is state; left broadcast, every step restarted from it.
    candidates = [
        p
        for p in params
        if p in declared
        or _candidate(kinds.get(p), values[p], num_steps)
        or (p == options.instance and p not in options.broadcast and _has_arrays(values[p]))
    ]
    first = analysis.returns[0] if analysis.returns else None
    unpacked = 0
    keys: tuple[Any, ...] = ()  # a returned dict's, when its items are the positions
    matched: dict[str, tuple[int, str]] = {}
    state_at = dict(options.state_at)

    def evaluate() -> Any:
        try:
            return eval_one_step(fn, params, values, for_eval, num_steps)
        except Exception as e:
            # The step failed on an argument taken as broadcast for the evaluation: the
            # leading-axis error says what to declare.
            raise_leading_axis_errors(analysis, kinds, deferred, values, num_steps, options, e)
            raise

    if state_at and first is not None and first.kind == "single":
        # `state={"params": 0, "opt_state": 1}` beside `return update(...)`: positions of the
        # items of its value, unless the whole value is the one state parameter named.
        out = evaluate() if out is None else out
        if type(out) is tuple and not (
            set(state_at.values()) == {0} and all(same_value(values[p], out) for p in state_at)
        ):
            unpacked = len(out)
            first = dataclasses.replace(first, kind="tuple", names=(None,) * unpacked, gradients=())
    arity = 0 if first is None or first.kind == "none" else len(first.names)
    for p, pos in state_at.items():
        if pos >= arity:
            raise error(
                OptionError,
                STATE_POSITION,
                analysis,
                param=p,
                pos=pos,
                returns="; ".join(r.describe() for r in analysis.returns) or "no return",
                count=f"{arity} value{'s' if arity != 1 else ''}"
                + (" (the items of the tuple its expression gives)" if unpacked else ""),
            )
        matched[p] = (pos, f"state= at return position {pos}")
    open_positions = []
    if first is not None and first.kind != "none":
        taken = set(returned_at.values()) | set(state_at.values())
        open_positions = [pos for pos in range(len(first.names)) if pos not in taken]
    pending = [p for p in candidates if p not in matched]
    # Python numbers static with num_steps > 1, which a return may give back changed.
    numbers = [
        p
        for p in params
        if num_steps > 1
        and kinds.get(p, ("",))[0] == "static"
        and type(values[p]) in (int, float)
        and for_eval[p] == "static"
    ]
    # Named in some returns, another expression at that position in others (`return p, s,
    # loss` in a branch, `return new_p, new_s, loss`): that position is its place.
    partly = {p: pos for p, pos in named_in_some(analysis, options).items() if p not in matched}
    counters: dict[str, int] = {}
    if (pending or numbers or partly) and open_positions and first is not None:
        out = evaluate() if out is None else out
        outputs = positions_of(first, out)
        for p, pos in partly.items():
            if not same_value(values[p], outputs[pos]):
                raise _matching.disagree(analysis, p, pos)
            matched[p] = (pos, f"returned by name at return position {pos} in some returns")
        pending = [p for p in pending if p not in matched]
        open_positions = [pos for pos in open_positions if pos not in partly.values()]
        # The parameters that could come back through a return, in order: not a method's
        # instance, those named broadcast=, or state written back into the caller's objects
        # (counted, a step's `(self, w, x)` put `w` at the second place).
        carried = [
            p
            for p in params
            if for_eval[p] not in ("scanned", "static")
            and p not in options.broadcast
            and p != options.instance
            and p not in mutable
        ]

        def alike(returned: Return) -> Callable[..., dict[str, tuple[int, str]] | None]:
            # Several parameters alike, as many positions: settled by data flow, then names.
            return functools.partial(
                _matching.settle_alike, names=returned.names, flow=flow_of(returned)
            )

        def flow_of(returned: Return) -> Callable[[], Any]:
            return functools.cache(
                lambda: flows(
                    fn, params, values, for_eval, num_steps, lambda o: positions_of(returned, o)
                )
            )

        # Gradients (`return loss, grads` after `jax.value_and_grad(loss)(params, x)`) are
        # not the new value of the parameters they are taken at: at num_steps > 1 carrying
        # them as params trained on the gradients. A previous gradient may be state.
        gradients: dict[int, set[str]] = {}
        for r in analysis.returns:
            for pos, at in r.gradients:
                gradients.setdefault(pos, set()).update(at)

        def settle(returned: Return, outs: list[Any], positions: list[int]) -> Any:
            # Python counters first (they take a place among the parameters only if carried),
            # then the candidates by value.
            places = _matching.places([p for p in params if p in carried or p in numbers], returned)
            found = _matching.counters(numbers, values, positions, outs, places)
            left = [pos for pos in positions if pos not in found.values()]
            places = _matching.places([p for p in params if p in carried or p in found], returned)
            by_value = _matching.match(
                analysis, params, values, pending, left, outs, declared, places,
                alike(returned), flow_of(returned), returned.names, gradients,
            )  # fmt: skip
            instance = options.instance
            if (
                instance in by_value
                and instance not in flow_of(returned)()[by_value[instance][0]][1]
            ):
                # A method's instance only where some leaf is its own, or computed by an
                # operation taking its own arrays (`self.replace(w=self.w - g)`), not for
                # gradients alike it (`return loss, self.loss_and_grad(x)[1]`).
                del by_value[instance]
            return found, by_value

        counters, by_value = settle(first, outputs, open_positions)
        if not (counters or by_value) and first.kind == "single" and _matching.unpackable(out):
            # `return update(params, opt_state, batch)`, `return {"params": ..., ...}`: no
            # parameter is the whole value, so its items may be the return positions, as if
            # the step returned them one by one; only where the step's data flow says so
            # (some item's last operation takes its parameter's own arrays, `p + u`), not for
            # `return jax.value_and_grad(loss)(params, x)`, whose gradients look like params.
            each = dataclasses.replace(first, kind="tuple", names=(None,) * len(out), gradients=())
            if isinstance(out, dict):
                names = tuple(k if isinstance(k, str) else None for k in out)
                each = dataclasses.replace(each, names=names, keys=tuple(out))
            contents = positions_of(each, out)
            items = list(range(len(contents)))
            found, by_value = settle(each, contents, items)
            direct = flow_of(each)() if by_value else []
            if any(p in direct[pos][1] for p, (pos, _) in by_value.items()):
                counters, unpacked, first = found, len(contents), each
                keys = each.keys
                open_positions, outputs = items, contents
            else:
                by_value = {}
        matched.update(by_value)
    else:
        outputs = None
    if state_at:
        out = evaluate() if out is None else out
        check_state_at(analysis, values, state_at, positions_of(first, out))
    if num_steps > 1 and outputs and first is not None:
        refuse_nested_state(analysis, values, pending, matched, open_positions, outputs, num_steps)
    for p, pos in counters.items():
        matched[p] = (
            pos,
            f"a Python {type(values[p]).__name__} that return position {pos} gives back "
            "changed: carried as an array",
        )
        for_eval[p] = "state"
    if num_steps > 1 and first is not None and first.kind != "none":
        out = check_per_step_returned(
            analysis, fn, params, values, kinds, for_eval, options, matched, open_positions,
            first, out, num_steps,
        )  # fmt: skip
    raise_leading_axis_errors(
        analysis,
        {p: k for p, k in kinds.items() if p not in matched},
        deferred,
        values,
        num_steps,
        options,
        None,
    )
    missing = sorted(p for p in declared if p not in matched)
    if missing:
        raise error(
            OptionError,
            STATE_NOT_MATCHED,
            analysis,
            param=missing[0],
            returns="; ".join(r.describe() for r in analysis.returns) or "no return",
        )
    if keys:  # a returned dict's positions are its keys
        matched = {
            p: (pos, re.sub(rf"return position {pos}\b", f"return key {keys[pos]!r}", why))
            for p, (pos, why) in matched.items()
        }
    run_kinds = tuple((p, role, why) for p, (role, why) in kinds.items() if p not in matched)
    run_time = RunTime(
        kinds=run_kinds,
        matched=tuple((p, pos, why) for p, (pos, why) in matched.items()),
        unpacked=unpacked,
        keys=keys,
    )
    roles = assign_roles(analysis, options, mutable, run_time)
    positions = {**{p: pos for p, (pos, _) in matched.items()}, **returned_at}
    to_array = scalars_to_array(fn, roles, values, positions, for_eval, num_steps, out, first)
    return Inferred(roles, to_array)


def _has_arrays(value: Any) -> bool:
    """A pytree node (not a leaf) with array leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return not jax.tree_util.treedef_is_leaf(treedef) and any(is_array(x) for x in leaves)


def _candidate(kind: tuple[Role, str] | None, value: Any, num_steps: int) -> bool:
    """Whether an open argument may turn out to be state returned under another name: with
    num_steps > 1 what is the same every step; with 1, containers and modules (a bare array
    gains nothing from being state at one step a call, and is returned as it is)."""
    if kind is None or kind[0] not in ("scanned", "broadcast"):
        return False
    if num_steps > 1:
        return kind[0] == "broadcast"
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


def _kind(analysis: Analysis, p: str, value: Any, num_steps: int) -> tuple[Role, str] | Exception:
    """The role of an argument the source and options leave open, from its value, or the
    error for an argument with mixed leading axes (raised unless it is matched as state)."""
    if isinstance(value, _STATIC_SCALARS) or (num_steps > 1 and isinstance(value, SCALARS)):
        return "static", f"a Python {type(value).__name__}, static as in eqx.filter_jit"
    leaves = jax.tree_util.tree_leaves(value)
    untraceable = [x for x in leaves if not (is_array(x) or isinstance(x, SCALARS))]
    if untraceable:
        return "broadcast", f"{_describe(value)}, holds values JAX cannot trace"
    if num_steps == 1:
        return "scanned", "per-step input"
    if (
        num_steps == 2
        and _matching.is_key(value)
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    ):
        # A raw `jax.random.PRNGKey` (uint32[2]) has a leading axis of 2: sliced per step, each
        # step got one uint32 and JAX's key check failed; but it may be two steps' counts.
        return error(ShapeError, RAW_KEY_OR_PER_STEP, analysis, param=p)
    arrays = [x for x in leaves if is_array(x)]
    with_axis = [x for x in arrays if np.ndim(x) >= 1 and np.shape(x)[0] == num_steps]
    if arrays and len(with_axis) == len(leaves):
        return "scanned", f"per-step: leading axis {num_steps} = num_steps at the first call"
    if not with_axis:
        return "broadcast", f"no leading axis of num_steps={num_steps} at the first call"
    paths = jax.tree_util.tree_flatten_with_path(value)[0]
    bad = next(
        (path, leaf)
        for path, leaf in paths
        if not (is_array(leaf) and np.ndim(leaf) >= 1 and np.shape(leaf)[0] == num_steps)
    )
    return error(
        ShapeError,
        MIXED_ARGUMENT,
        analysis,
        param=p,
        path=f"{p}{jax.tree_util.keystr(bad[0])}",
        shape=_shape_of(bad[1]),
        num_steps=num_steps,
    )


def _defaulted(fn: Callable[..., Any], values: dict[str, Any]) -> set[str]:
    """The parameters whose value is their default (the call did not pass them)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {
        p.name
        for p in parameters
        if p.default is not inspect.Parameter.empty
        and p.name in values
        and values[p.name] is p.default
        and jax.tree_util.tree_leaves(p.default)
    }


def _describe(value: Any) -> str:
    """`a Model`, `a flax.Optimizer`, `a equinox.MLP`: the class, with its library's name."""
    t = value.__class__  # a handle's: its object's class
    root = t.__module__.split(".")[0]
    known = ("flax", "equinox", "optax", "jax", "haiku", "numpy")
    return f"a {root}.{t.__qualname__}" if root in known else f"a {t.__qualname__}"


def _shape_of(x: Any) -> str:
    if is_array(x):
        return f"{jax.numpy.result_type(x)}{list(np.shape(x))}"
    return f"non-array {type(x).__name__}"
