"""Readings of a first call that autoflat will not choose between: each is an error naming the
option that settles it, since guessed wrong it trains silently wrong.

- **Leading axes that do not settle an argument's role** (with `num_steps > 1`): an argument
  whose array leaves have mixed leading axes, a raw `uint32[2]` PRNG key at `num_steps=2`
  (two steps' counts, or one key?), and a first call whose only candidates all have a
  shorter leading axis (a short first chunk, or a full batch reused?). All wait until state
  is matched by value (a state argument returned under another name may have leaves of any
  leading axis) and name the options that settle them.
- **Per-step or state?** (with `num_steps > 1`): an argument the body writes into whose arrays
  all have a leading axis of num_steps (a per-step batch changed locally, or state?), a
  per-step-looking container that a return position gives back one step's slice of (state
  whose first axis happens to be num_steps?), and a per-step-looking bare array given back
  at its place under another name, where both readings type-check. All name `per_step=` and
  `state=`.
- **A parameter given back as it came in, at another's place** (with `num_steps > 1`): `return
  new, params` for `(params, prev)` with `params` never assigned, and `prev` alike: by name,
  `params` is carried unchanged; as a `lax.scan` carry, position 0 is the new `params` and
  `prev` takes the old one. Names `state=` for each.
- **State returned nested in an output** (with `num_steps > 1`): `return (params, opt_state),
  loss` would take both as broadcast inputs, every step starting again from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis
from .._errors import (
    MIXED_ARGUMENT,
    PASSED_THROUGH,
    PER_STEP_OR_STATE,
    RAW_KEY_OR_PER_STEP,
    SHORT_FIRST_CHUNK,
    STATE_AT_NESTED,
    STATE_NESTED,
    STATE_TYPE_CHANGED,
    STATE_UNLINKED,
    WRITTEN_PER_STEP,
    OptionError,
    ShapeError,
    error,
)
from .._handles.writeback import is_mutable_module
from .._transport.structure import is_array
from .abstract import abstract_leaves, eval_one_step, positions_of, same_value
from .flow import Flow, scalar_container
from .matching import is_key, names_gradients
from .options import Options, Role


def check_per_step_returned(
    analysis: Analysis,
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    kinds: dict[str, Role],
    for_eval: dict[str, Role],
    options: Options,
    given_back: dict[str, int],
    open_positions: list[int],
    first: Any,
    out: Any,
    num_steps: int,
) -> Any:
    """A container whose every array leaf has a leading axis of num_steps looks per-step; if a
    return position gives back one step's slice of it (same structure, shapes and dtypes), it
    may instead be state whose first axis happens to be num_steps (a model with 4 outputs at
    num_steps=4), returned under another name: sliced per step, it would train silently wrong.
    The user says which. Returns one step's abstract output (evaluated here if not yet)."""
    taken = set(given_back.values())
    left = [pos for pos in open_positions if pos not in taken]
    scanned = [
        p
        for p in params
        if kinds.get(p) == "scanned"
        and p not in options.per_step
        and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(values[p]))
    ]
    if not (left and scanned):
        return out
    if out is None:
        try:
            out = eval_one_step(fn, params, values, for_eval, num_steps)
        except Exception:
            return None  # the step's own trace raises it again, with its line
    outputs = positions_of(first, out)
    if not outputs:
        return out
    for p in scanned:
        rebuild, abstract = abstract_leaves(values[p], drop_axis=True)
        sliced = rebuild(abstract)
        hits = [pos for pos in left if same_value(sliced, outputs[pos])]
        if hits:
            raise error(
                ShapeError,
                PER_STEP_OR_STATE,
                analysis,
                param=p,
                position=hits[0],
                num_steps=num_steps,
            )
    return out


def check_array_per_step_returned(
    analysis: Analysis,
    values: dict[str, Any],
    places: dict[str, int],
    outputs: list[Any],
    carried: Callable[[str], list[Any] | None],
    num_steps: int,
) -> None:
    """A bare array whose leading axis is num_steps looks per-step (rule 10), but where the
    return position at its place among the parameters that could be state (`places`, where
    the step returns a name that shares a word with it: `v2 = v * 0.5 + ...`, `return v2`)
    gives back one step's slice of it, and the same step with it carried whole (`carried`: that
    evaluation's positions) gives back its whole shape there, both readings type-check:
    per-step values mapped one by one, or state whose first axis happens to be num_steps
    (with shape (3,) at num_steps=4 it is matched as state). Either guess trains silently
    wrong when it is the other: the user says which."""
    for p, pos in places.items():
        rebuild, abstract = abstract_leaves(values[p], drop_axis=True)
        if not same_value(rebuild(abstract), outputs[pos]):
            continue
        whole = carried(p)
        if whole and same_value(values[p], whole[pos]):
            raise error(
                ShapeError, PER_STEP_OR_STATE, analysis, param=p, position=pos, num_steps=num_steps
            )


def check_written_per_step(
    analysis: Analysis,
    options: Options,
    returned_at: dict[str, int],
    mutable: frozenset[str],
    values: dict[str, Any],
    num_steps: int,
) -> None:
    """An argument the body writes into (`batch["x"] = ...`, `batch.update(...)`) is state,
    carried from step to step and written back. One whose array leaves all have a leading axis
    of num_steps looks like a per-step input changed locally, as under `jax.jit` (each step
    would see the whole chunk): the user says which. A Flax NNX object is not asked about:
    it is state whatever its shapes (an `nnx.Linear(4, 4)`, four layers scanned over, at
    num_steps=4), as nothing would feed a model per step."""
    written = (set(analysis.assigned) | mutable) - set(returned_at) - options.state
    written -= options.explicit
    for p, value in values.items():
        if p not in written or is_mutable_module(value):
            continue
        leaves = jax.tree_util.tree_leaves(value)
        if leaves and all(
            is_array(x) and np.ndim(x) >= 1 and np.shape(x)[0] == num_steps for x in leaves
        ):
            line = dict(analysis.assigned_lines).get(p) or next(
                (ln for q, _, ln in analysis.in_place if q == p), analysis.def_line
            )
            raise error(
                ShapeError, WRITTEN_PER_STEP, analysis, param=p, line=line, num_steps=num_steps
            )


def raw_key_at_two(value: Any, num_steps: int) -> bool:
    """A raw `jax.random.PRNGKey` (uint32[2]) at num_steps=2: its leading axis of 2 may be
    two steps' counts or one key, which sliced per step would give each step one uint32
    (and JAX's key check would fail)."""
    return (
        num_steps == 2
        and is_key(value)
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    )


def leading_axis_error(analysis: Analysis, p: str, value: Any, num_steps: int) -> Exception:
    """The error for an argument whose leading axes no rule settles (raised unless it is
    matched as state): a raw PRNG key at num_steps=2 (`raw_key_at_two`), or array leaves
    with and without a leading axis of num_steps (mixed)."""
    if raw_key_at_two(value, num_steps):
        return error(ShapeError, RAW_KEY_OR_PER_STEP, analysis, param=p)
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


def _shape_of(x: Any) -> str:
    if is_array(x):
        return f"{jax.numpy.result_type(x)}{list(np.shape(x))}"
    return f"non-array {type(x).__name__}"


def raise_leading_axis_errors(
    analysis: Analysis,
    kinds: dict[str, Role],
    deferred: dict[str, Exception],
    values: dict[str, Any],
    num_steps: int,
    options: Options,
    cause: BaseException | None,
) -> None:
    """Raise the first leading-axis error of an argument that is not state: mixed leading
    axes, or a short first chunk."""
    found = next((deferred[p] for p in kinds if p in deferred), None)
    if found is None and num_steps > 1:
        found = _short_first_chunk(analysis, kinds, values, num_steps, options)
    if found is not None:
        raise found from cause


def _short_first_chunk(
    analysis: Analysis,
    kinds: dict[str, Role],
    values: dict[str, Any],
    num_steps: int,
    options: Options,
) -> Exception | None:
    """A first call with no per-step argument, where an argument's array leaves all share a
    leading axis shorter than num_steps, is ambiguous: a short first chunk, or a batch reused
    for every step? The user says which."""
    if options.per_step or any(role == "scanned" for role in kinds.values()):
        return None
    for p, role in kinds.items():
        if role != "broadcast":
            continue
        arrays = [x for x in jax.tree_util.tree_leaves(values[p]) if is_array(x)]
        lengths = {np.shape(x)[0] if np.ndim(x) else -1 for x in arrays}
        if arrays and len(lengths) == 1:
            (length,) = lengths
            if 0 < length < num_steps:
                return error(
                    ShapeError,
                    SHORT_FIRST_CHUNK,
                    analysis,
                    param=p,
                    length=length,
                    num_steps=num_steps,
                )
    return None


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
) -> None:
    """A container argument left broadcast whose value comes back nested inside an output
    (`return (params, opt_state), loss`): at num_steps > 1 every step would restart from the
    value passed in, silently. Refused, with the fix."""
    for p, pos in _open_containers(values, pending, given_back, positions):
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


def refuse_changed_type(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    positions: list[int],
    outputs: list[Any],
    num_steps: int,
    evidence: Callable[[str, int], bool],
) -> None:
    """A container argument left broadcast where an open return position has its leaf
    shapes, its tree (tuples and lists alike) and evidence of being its new value
    (`evidence`: `_Inference._new_value_of`), but another dtype (bfloat16 parameters updated
    with a float32 rate) or container type (a tuple of layers given back as a list): as a
    `lax.scan` carry it cannot be (its types must stay), and left broadcast every step
    would restart from the value passed in. Refused, with both fixes."""
    for p, pos in _open_containers(values, pending, given_back, positions):
        changed = _type_changed(values[p], outputs[pos])
        if changed is not None and evidence(p, pos):
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
    evidence: Callable[[str, int], bool],
    gradients: set[int],
    num_steps: int,
    per_step: frozenset[str],
) -> None:
    """A container matched to a return position by its abstract value alone (rule 3), where
    some leaf there is not computed from it (nor another argument's leaf as it came, nor
    made from per-step arguments alone: the input in an RNN carry `(h, x)`, `(h, x / 2)`),
    or the position returns gradients in every `return` (`gradients`: computed from
    whatever the loss reads; unless the parameter's name says gradients, `prev_grads`),
    and nothing else says the position is its new value (`named`: a returned name sharing
    a word with it, `g` for `prev_g`; for other than gradients, `evidence`: named parts
    computed from it, an addition taking its own array): the type is all that links them
    (a tuple of clip bounds beside a metrics tuple, a teacher's parameters beside the
    returned gradients). Carried, each step would start from what is maybe a metric;
    broadcast, from a value maybe stale. With num_steps > 1, refused with both fixes. (A
    bare array matches only at its place, with its own evidence: `matching.bare_at_place`.)"""
    for p, pos in by_value.items():
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(values[p])):
            continue
        if named(p, pos):
            continue
        if pos in gradients:
            if names_gradients(p):  # (`prev_grads` given back the new gradients)
                continue
            why = "it holds gradients, computed from whatever the loss reads"
        else:
            here = flow()[pos]
            # (a leaf given back as another argument's leaf came, or made from this step's
            # inputs alone, is a carry's input: `(h, x)`, `(h, x / 2)`)
            unlinked = [
                i
                for i, (sources, owner) in enumerate(zip(here.leaves, here.owners, strict=True))
                if p not in sources and owner is None and not (sources and sources <= per_step)
            ]
            paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(outputs[pos])[0]]
            if unlinked:
                at = jax.tree_util.keystr(paths[unlinked[0]])
                why = f"its leaf at `{at}` is not computed from `{p}`"
            elif reduced := _only_reduced(p, values[p], here, per_step):
                at = jax.tree_util.keystr(paths[reduced[0]])
                why = (
                    f"its leaf at `{at}` is computed from `{p}` only through a reduction of "
                    f"arrays `{p}` was spread over (a mean, a sum, a norm), as a metric is"
                )
            else:
                continue
            if evidence(p, pos):
                continue
        raise error(
            OptionError, STATE_UNLINKED, analysis, param=p, pos=pos, why=why,
            num_steps=num_steps,
        )  # fmt: skip


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
            "the same container types, `tuple(...)` where a list is built",
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
    return hasattr(x, "shape") and hasattr(x, "dtype")


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


def _nested_path(value: Any, out: Any, name: str) -> str | None:
    """Where inside `out` (not `out` itself) a value like `value` is, if anywhere; of several,
    one whose path names `name` (`{"params": ..., "ema": ...}` alike)."""
    found = jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: x is not out and same_value(value, x)
    )[0]
    paths = [jax.tree_util.keystr(path) for path, sub in found if path and same_value(value, sub)]
    named = [p for p in paths if f"['{name}']" in p or f".{name}" in p]
    return next(iter(named or paths), None)
