"""Readings of returned state that a first call leaves open, which autoflat will not choose
between: each is an error naming the option that settles it, since guessed wrong it trains
silently wrong. All with `num_steps > 1`, where a `lax.scan` carries state.

- **A parameter given back as it came in, at another's place**: `return new, params` for
  `(params, prev)` with `params` never assigned, and `prev` alike: by name, `params` is
  carried unchanged; as a `lax.scan` carry, position 0 is the new `params` and `prev` takes
  the old one. Names `state=` for each.
- **State returned nested in an output**: `return (params, opt_state), loss` would take both
  as broadcast inputs, every step starting again from them; `state={"params": 0}` naming
  such a position.
- **A bare array given back away from its place** (`refuse_away_from_place`): `return w,
  loss, step + 1` for `(w, step, x)`, the position computed from it; matched only at its
  place, it would be broadcast. Names `state=` and `broadcast=`.
- **A container whose new value changes its types** (bfloat16 parameters updated with a
  float32 rate, a tuple given back as a list): no `lax.scan` carry can.
- **A container matched to a position by its type alone** (`refuse_unlinked`): a leaf there
  not computed from it, gradients, or for a container of scalar arrays a leaf computed from
  it only through a reduction of arrays it was spread over (`Flow.smooth`), or summing its
  leaf times a value of the step (`Flow.weighted`: `alpha * kd`): clip bounds, input
  statistics or loss weights beside a metrics tuple, a teacher beside returned gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis
from .._errors import (
    PASSED_THROUGH,
    STATE_AT_NESTED,
    STATE_AWAY_FROM_PLACE,
    STATE_NESTED,
    STATE_TYPE_CHANGED,
    STATE_UNLINKED,
    OptionError,
    error,
)
from .._transport.structure import attribute, is_array
from .abstract import same_value
from .flow import Flow, scalar_container
from .matching import is_key
from .names import name_at, names_gradients
from .options import Options


def refuse_passed_through(
    analysis: Analysis,
    options: Options,
    values: dict[str, Any],
    returned_at: dict[str, int],
    places: dict[str, int],
    num_steps: int,
) -> None:
    """Refuse a parameter every return gives back by name (rule 2) but that the body never
    assigns, at a position that is the place of another parameter alike it (see the module
    doc). `places`: each parameter that could be state with its own return position."""
    if num_steps == 1:  # each position comes back as the body computed it, either way
        return
    at_place = {pos: q for q, pos in places.items()}
    declared = dict(options.state_at)
    for p, pos in returned_at.items():
        other = at_place.get(pos)
        if (
            p in analysis.rebound
            or p in declared
            or other is None
            or other == p
            or other in declared
            or other in options.explicit
            or p not in places
            or not same_value(values[p], values[other])
        ):
            continue
        order = ", ".join(sorted(places, key=places.__getitem__))
        raise error(
            OptionError, PASSED_THROUGH, analysis, param=p, pos=pos, other=other,
            place=places[p], order=order, num_steps=num_steps,
        )  # fmt: skip


def refuse_nested_state(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    positions: list[int],
    outputs: list[Any],
    num_steps: int,
    flow: Callable[[], list[Flow]],
) -> None:
    """A container argument left broadcast whose value comes back nested inside an output
    (`return (params, opt_state), loss`), or an array (not a scalar) whose new value does,
    computed from it other than through reductions alone (`(new_mu, new_var)` for `mu` and
    `var`, `new_mu = 0.9 * mu + 0.1 * x.mean(0)`): at num_steps > 1 every step would restart
    from the value passed in, silently. Refused, with the fixes."""
    taken = set(given_back.values())
    bare = [
        (p, pos)
        for p in pending
        if p not in given_back and is_array(values[p]) and np.ndim(values[p]) > 0
        for pos in positions
        if pos not in taken
    ]
    for p, pos in [*_open_containers(values, pending, given_back, positions), *bare]:
        if (p, pos) in bare:
            path = _nested_array(p, values[p], outputs[pos], flow()[pos])
        else:
            path = _nested_path(values[p], outputs[pos], p)
        if path is not None:
            raise error(
                OptionError,
                STATE_NESTED,
                analysis,
                param=p,
                pos=pos,
                path=f"[{pos}]{path}",
                num_steps=num_steps,
            )


def _open_containers(
    values: dict[str, Any], pending: list[str], given_back: dict[str, int], positions: list[int]
) -> Iterator[tuple[str, int]]:
    """Each container argument with arrays that no position gives back, with each open
    return position (a bare array is matched only at its place, with its data flow)."""
    taken = set(given_back.values())
    for p in pending:
        value = values[p]
        if p in given_back or not jax.tree_util.tree_leaves(value):
            continue
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            continue
        for pos in positions:
            if pos not in taken:
                yield p, pos


def refuse_away_from_place(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    positions: list[int],
    outputs: list[Any],
    flow: Callable[[], list[Flow]],
    places: dict[str, int],
    names: tuple[str | None, ...],
    gradients: dict[int, set[str]],
    num_steps: int,
) -> None:
    """A bare array left broadcast (matched at no position: a bare array only at its place)
    where an open return position other than its place has its shape and dtype and is
    computed from it (`step + 1`, `(step + 1) % n`, `jnp.clip(0.9 * v - g, -1, 1)` after a
    loss at its place): maybe its new value, which broadcast every step would discard (a
    step counter staying at its first value). Not where the position gives it back as it
    came (carried or not, the same values), weighs it by another value (`g * scale`), or
    holds gradients taken at it (`gradients`). Refused, with both fixes."""
    taken = set(given_back.values())
    for p in pending:
        value = values[p]
        if p in given_back or p not in places or not is_array(value) or is_key(value):
            continue
        for pos in positions:
            here = flow()[pos] if pos not in taken and pos != places[p] else None
            if (
                here is None
                or not same_value(value, outputs[pos])
                or p not in here.sources
                or here.owners == (p,)
                or p in gradients.get(pos, ())
                or any(w.param == p for ws in here.weighted for w in ws)
            ):
                continue
            name = name_at(names, pos)
            how = (
                f"made by an operation taking `{p}`'s own array"
                if p in here.direct
                else f"computed from `{p}`"
            )
            raise error(
                OptionError, STATE_AWAY_FROM_PLACE, analysis, param=p, pos=pos,
                returned="an expression" if name is None else f"`{name}`", how=how,
                place=places[p], num_steps=num_steps,
            )  # fmt: skip


def refuse_changed_type(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    positions: list[int],
    outputs: list[Any],
    num_steps: int,
    evidence: Callable[[str, int], bool],
    flow: Callable[[], list[Flow]],
    per_step: frozenset[str],
) -> None:
    """A container argument left broadcast where an open return position has its leaf
    shapes, its tree (tuples and lists alike) and evidence of being its new value
    (`evidence`: `Inference.new_value_of`; for a container type changed, also every leaf
    computed from it or made from per-step arguments alone, one at least from it: an RNN's
    list carry `[h, c]` given back as `(h, c)`, `[h, prev_x]` as `(h, x)`), but another
    dtype (bfloat16 parameters updated with a float32 rate) or container type (a tuple of
    layers given back as a list): as a `lax.scan` carry it cannot be (its types must stay),
    and left broadcast every step would restart from the value passed in. Refused, with both
    fixes."""
    for p, pos in _open_containers(values, pending, given_back, positions):
        changed = _type_changed(values[p], outputs[pos])
        if changed is None:
            continue
        if evidence(p, pos) or (
            changed[0] == "tree structure" and _carried_leaves(p, flow()[pos], per_step)
        ):
            what, detail, fix = changed
            raise error(
                OptionError, STATE_TYPE_CHANGED, analysis, param=p, pos=pos, what=what,
                detail=detail, fix=fix, num_steps=num_steps,
            )  # fmt: skip


def refuse_unlinked(
    analysis: Analysis,
    values: dict[str, Any],
    by_value: dict[str, int],
    outputs: list[Any],
    flow: Callable[[], list[Flow]],
    named: Callable[[str, int], bool],
    within: Callable[[str, int], bool],
    evidence: Callable[[str, int, bool], bool],
    gradients: set[int],
    num_steps: int,
    per_step: frozenset[str],
    varying: frozenset[str],
) -> None:
    """A container matched to a return position by its abstract value alone (rule 3), where
    some leaf there is not computed from it (nor another argument's leaf as it came, nor
    made from per-step arguments alone: the input in an RNN carry `(h, x)`, `(h, x / 2)`),
    or the position returns gradients in every `return` (`gradients`: computed from
    whatever the loss reads; unless the parameter's name says gradients, `prev_grads`),
    and nothing else says the position is its new value (for gradients, `named`: a returned
    name sharing a word with it that says gradients only if its own does, `g` for `prev_g`,
    not `params_grads` for `teacher_params`; for other positions a name holding its head
    word, `within`, or `evidence`: named parts computed from it, an addition taking its own
    array): the type is all that links them
    (a tuple of clip bounds beside a metrics tuple, a teacher's parameters beside the
    returned gradients). For a container of scalar arrays also a leaf computed from it only
    through reductions (`_only_reduced`), or weighing a value of the step by one of its
    leaves (`_weighs`; `varying`: the per-step inputs and the state other than scalars),
    where, for a dict whose leaf is a value of the step times its own leaf and nothing more
    (`Weight.bare`), only an addition taking its own leaf is evidence (its keys are not:
    loss weights `{"ce": w_ce, "l2": w_l2}` beside the weighted loss parts of the same
    keys; a named tuple or a dataclass built again is).
    Carried,
    each step would start from what is maybe a metric; broadcast, from a value maybe stale.
    With num_steps > 1, refused with both fixes. (A bare array matches only at its place,
    with its own evidence: `matching.bare_at_place`.)"""
    for p, pos in by_value.items():
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(values[p])):
            continue
        if pos in gradients:
            if named(p, pos) or names_gradients(p):  # (`prev_grads` given the new gradients)
                continue
            why = "it holds gradients, computed from whatever the loss reads"
        else:
            found = _unlinked_leaf(p, values[p], flow(), pos, outputs[pos], per_step, varying)
            if found is None:
                continue
            why, weighs_alone = found
            # (a word shared beside another is no evidence where a leaf says metric: a tuple
            # of clip bounds beside the clipped gradients' extremes (`clip_bounds`,
            # `clip_stats`), loss weights beside the weighted loss parts (`loss_weights`,
            # `loss_parts`, or `loss`): only a name holding its head word says so
            # (`new_bounds`, `new_weights` for `expert_weights`). Nor are a dict's keys where a
            # leaf is a value of the step weighed by it and nothing more: loss weights and
            # loss parts share their keys by nature; `d * ema["loss"] + (1 - d) * loss` keeps
            # a running value)
            bare = weighs_alone and isinstance(values[p], dict)
            if within(p, pos) or evidence(p, pos, bare):
                continue
        raise error(
            OptionError, STATE_UNLINKED, analysis, param=p, pos=pos, why=why,
            num_steps=num_steps,
        )  # fmt: skip


def _unlinked_leaf(
    p: str,
    value: Any,
    flows: list[Flow],
    pos: int,
    out: Any,
    per_step: frozenset[str],
    varying: frozenset[str],
) -> tuple[str, bool] | None:
    """Why position `pos`, matched to `p` by its type alone, may not be its new value (the
    first leaf that says so), and whether that leaf is a value weighed by a leaf of `p` and
    nothing more (`_weighs`, `Weight.bare`); None if no leaf says so."""
    here = flows[pos]
    # (a leaf given back as another argument's leaf came, or made from this step's inputs
    # alone, is a carry's input: `(h, x)`, `(h, x / 2)`; not for a container of scalars,
    # where per-step rewards or batch statistics look as much like a metric logged beside
    # hyperparameters, `(reward, done)` beside `(gamma, lam)`)
    carry_inputs = not scalar_container(value)
    unlinked = [
        i
        for i, (sources, owner) in enumerate(zip(here.leaves, here.owners, strict=True))
        if p not in sources
        and not (carry_inputs and (owner is not None or (sources and sources <= per_step)))
    ]
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
    if unlinked:
        return f"its leaf at `{paths[unlinked[0]]}` is not computed from `{p}`", False
    if reduced := _only_reduced(p, value, here, per_step):
        return (
            f"its leaf at `{paths[reduced[0]]}` is computed from `{p}` only through a "
            f"reduction of arrays `{p}` was spread over (a mean, a sum, a norm), as a metric is"
        ), False
    if weighs := _weighs(p, value, here, varying):
        return (
            f"its leaf at `{paths[weighs[0]]}` sums a leaf of `{p}` times a value computed "
            f"from the step's other arguments (`alpha * kd`, `loss / scale`, or that product "
            f"alone), as a hyperparameter weighs a loss; a running value is kept as `0.9 * ema + "
            f"0.1 * loss`"
        ), any(w.bare for j in weighs for w in here.weighted[j] if w.param == p)
    if replaced := _replaced(p, flows, pos, per_step):
        at = paths[replaced[0]]
        return (
            f"its leaf at `{at}` is not computed from `{p}{at}`, which the step reads (state "
            f"that a step reads is computed from itself, `count + 1`, `0.9 * ema + 0.1 * "
            f"loss`; a metric beside hyperparameters is not)"
        ), False
    return None


def _replaced(p: str, flows: list[Flow], pos: int, per_step: frozenset[str]) -> list[int]:
    """For a container of scalar arrays, the leaves `j` of position `pos` not computed from
    its own leaf `j` where the step reads that leaf (`Flow.origins`): `(jnp.abs(td), td**2)`
    beside `(gamma, alpha)`, the TD error computed from `gamma` and weighed into the values
    by `alpha`. A leaf given back as an argument's leaf came, or made from per-step
    arguments alone, is a carry's input (`(h, x)`, a shift register); one made from the
    container's other leaves and per-step arguments is a schedule (`(count, lr)` given back
    `(count + 1, schedule(count))`); a leaf the step does not read may take any value
    (`(count + 1, loss)`; given back as it came is no read: `(prev, loss)` for `(prev2,
    prev)`)."""
    here = flows[pos]
    read = frozenset[tuple[str, int]]().union(
        *(o for f in flows for o, owner in zip(f.origins, f.owners, strict=True) if owner is None)
    )
    return [
        j
        for j, (origins, owner, sources) in enumerate(
            zip(here.origins, here.owners, here.leaves, strict=True)
        )
        if (p, j) in read
        and (p, j) not in origins
        and owner is None
        and not sources <= per_step | {p}
    ]


def _only_reduced(p: str, value: Any, flow: Flow, per_step: frozenset[str]) -> list[int]:
    """For a container of scalar arrays (`(count, total)`, `(mu, sd)`, `(lr, wd)`), the
    leaves of its position computed from it only through reductions of arrays it was spread
    over (`Flow.smooth`): the loss and gradient norm of a step that normalises its inputs by
    `(mu, sd)`, or whose loss adds `wd * jnp.sum(w**2)`. Scalar state is computed from itself
    otherwise (`count + 1`, `0.9 * ema + 0.1 * loss`, `jnp.min(jnp.stack([best, loss]))`);
    a leaf given back as an argument came, or made from per-step arguments alone, is a
    carry's input."""
    if not scalar_container(value):
        return []
    return [
        j
        for j, (sources, owner, smooth) in enumerate(
            zip(flow.leaves, flow.owners, flow.smooth, strict=True)
        )
        if owner is None and not (sources and sources <= per_step) and p not in smooth
    ]


def _weighs(p: str, value: Any, flow: Flow, varying: frozenset[str]) -> list[int]:
    """For a container of scalar arrays, the leaves of its position that sum one of its
    leaves times, or over, a value computed from the batch or the model (`varying`: the
    per-step inputs and the state other than scalars): `alpha * kd + (1 - alpha) * ce`
    beside `(alpha, T)`, `loss / loss_scale`, `y_std * jnp.mean(pred)`. A running value
    takes its own leaf times constants (`0.9 * ema + 0.1 * loss`, `lr * jnp.where(better,
    1.05, 0.5)`) or its other leaves (`mean * (n - 1) / n + x / n`), or normalised by a sum
    taking it (`a / (a + b)`), or its last operation takes its own leaf (`b - lr * gb`, a
    scalar model trained: its gradient multiplies `a` by the batch)."""
    if not scalar_container(value):
        return []
    return [
        j
        for j, (weights, takes) in enumerate(zip(flow.weighted, flow.takes, strict=True))
        if p not in takes and any(w.param == p and w.by & (varying - {p}) for w in weights)
    ]


def _carried_leaves(p: str, here: Flow, per_step: frozenset[str]) -> bool:
    """Every leaf computed from `p` or made from per-step arguments alone, one at least from
    `p`: a carry's new value, whatever its container."""
    leaves = here.leaves
    return any(p in sources for sources in leaves) and all(
        p in sources or (sources and sources <= per_step) for sources in leaves
    )


def _type_changed(value: Any, out: Any) -> tuple[str, str, str] | None:
    """How `out` differs from `value` where it has its leaf shapes (every leaf an array on
    both sides, as many) but another container type or dtype: (what, where, the fix)."""
    before = jax.tree_util.tree_flatten_with_path(value)[0]
    after = jax.tree_util.tree_flatten_with_path(out)[0]
    if not before or len(before) != len(after) or same_value(value, out):
        return None
    for (_, a), (_, b) in zip(before, after, strict=True):
        if not (is_array(a) and _is_abstract_array(b)) or np.shape(a) != tuple(b.shape):
            return None
        if any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in (a, b)):
            return None  # (a typed PRNG key: matched by its own rules)
    treedef: Any = jax.tree_util.tree_structure(value)
    out_treedef = jax.tree_util.tree_structure(out)
    if treedef != out_treedef:
        if _skeleton(treedef) != _skeleton(out_treedef):
            return None  # (another tree: a loss beside a one-leaf dict, a tuple beside a dict)
        return (
            "tree structure",
            f"{_outer(value)} comes back as {_outer(out)}",
            f"the same container types: `{type(value).__name__}(...)` where the step builds "
            f"`{type(out).__name__}`"
            if type(value) is not type(out)
            else "the same container types, `tuple(...)` where a list is built",
        )
    for (path, a), (_, b) in zip(before, after, strict=True):
        if np.dtype(a.dtype) != np.dtype(b.dtype):
            where = jax.tree_util.keystr(path) or "the value"
            return (
                "dtypes",
                f"{where}: {np.dtype(a.dtype).name} comes back as {np.dtype(b.dtype).name}",
                "each new leaf cast to its old dtype: `jax.tree.map(lambda new, old: "
                "new.astype(old.dtype), new, old)`",
            )
    return None


def has_named_parts(value: Any) -> bool:
    """Whether the tree of `value` has a node other than a tuple or a list: a dict (its
    keys), a named tuple, a dataclass or a module (its fields)."""
    return _named(jax.tree_util.tree_structure(value))


def _named(treedef: Any) -> bool:
    if jax.tree_util.treedef_is_leaf(treedef):
        return False
    kind, _ = treedef.node_data()
    if kind not in (tuple, list):
        return True
    return any(_named(c) for c in treedef.children())


def _skeleton(treedef: Any) -> Any:
    """A tree structure with tuples, lists and named tuples alike (a sequence of so many
    children), other nodes (a dict and its keys, a module) as they are."""
    if jax.tree_util.treedef_is_leaf(treedef):
        return "*"
    kind, data = treedef.node_data()
    if kind in (tuple, list) or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        kind, data = "sequence", None
    return kind, data, tuple(_skeleton(c) for c in treedef.children())


def _is_abstract_array(x: Any) -> bool:
    return attribute(x, "shape") is not None and attribute(x, "dtype") is not None


def _outer(value: Any) -> str:
    """The tree structure of `value`, briefly: its containers, its leaves as `*`."""
    text = str(jax.tree_util.tree_structure(value)).removeprefix("PyTreeDef(")
    text = text[:-1] if text.endswith(")") else text
    return text if len(text) <= 60 else text[:57] + "..."


def check_state_at(
    analysis: Analysis, values: dict[str, Any], state_at: dict[str, int], outputs: list[Any]
) -> None:
    """`state={"params": 0}` where return position 0 holds the new `params` inside it
    (`return (params, opt_state), loss`): the position given is not the value itself. A bare
    array too (`return (p, opt_state), loss` with `p` one array): the user named that
    position, so a value like it inside is theirs, where carried it would change the state's
    structure after one step."""
    for p, pos in state_at.items():
        value = values[p]
        if same_value(value, outputs[pos]):
            continue
        path = _nested_path(value, outputs[pos], p)
        if path is not None:
            raise error(
                OptionError, STATE_AT_NESTED, analysis, param=p, pos=pos, path=f"[{pos}]{path}"
            )


def _nested_array(p: str, value: Any, out: Any, here: Flow) -> str | None:
    """Where inside `out` (a container) a leaf of `value`'s shape and dtype computed from `p`
    other than through reductions alone is, if anywhere."""
    found = jax.tree_util.tree_flatten_with_path(out)[0]
    if len(found) < 2 and not any(path for path, _ in found):
        return None  # (a bare array position: matched at its place, `matching.bare_at_place`)
    for (path, leaf), smooth in zip(found, here.smooth, strict=True):
        same = np.shape(leaf) == np.shape(value) and attribute(leaf, "dtype") == value.dtype
        if same and p in smooth:
            return jax.tree_util.keystr(path)
    return None


def _nested_path(value: Any, out: Any, name: str) -> str | None:
    """Where inside `out` (not `out` itself) a value like `value` is, if anywhere; of several,
    one whose path names `name` (`{"params": ..., "ema": ...}` alike)."""
    found = jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: x is not out and same_value(value, x)
    )[0]
    paths = [jax.tree_util.keystr(path) for path, sub in found if path and same_value(value, sub)]
    named = [p for p in paths if f"['{name}']" in p or f".{name}" in p]
    return next(iter(named or paths), None)
