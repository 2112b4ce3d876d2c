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
- **Flax NNX objects inside a container** the body changes in place (not given back): their
  changes would be lost; the error asks to pass each as a parameter of its own.

Readings of returned state autoflat will not choose between are `state_hazards`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._analysis.analysis import Analysis
from .._errors import (
    MIXED_ARGUMENT,
    MIXED_VARIADIC,
    NNX_NESTED,
    PER_STEP_BY_SHAPE_NOTE,
    PER_STEP_OR_STATE,
    RAW_KEY_OR_PER_STEP,
    REBOUND_PER_STEP,
    RETURNED_PER_STEP,
    SHORT_FIRST_CHUNK,
    SLICED_FAILS,
    WRITTEN_PER_STEP,
    ShapeError,
    StateError,
    error,
)
from .._handles.nnx import nested_module
from .._handles.writeback import is_mutable_module
from .._transport.structure import is_array
from .abstract import abstract_leaves, changes_inside, eval_one_step, positions_of, same_value
from .flow import Flow
from .matching import is_key
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
        except Exception as e:
            traces = [
                p
                for p in scanned
                if gives_back_whole(p, left, first, fn, params, values, for_eval, num_steps)
            ]
            check_sliced_fails(analysis, traces, e, num_steps)
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
                given=_SLICE,
            )
    return out


def gives_back_whole(
    p: str,
    left: list[int],
    first: Any,
    fn: Any,
    params: tuple[str, ...],
    values: dict[str, Any],
    for_eval: dict[str, Role],
    k: int,
) -> bool:
    """Whether one step, with `p` carried whole, evaluates and gives back a value of `p`'s
    whole structure, shapes and dtypes at an open return position (`left`)."""
    try:
        out = eval_one_step(fn, params, values, {**for_eval, p: "state"}, k)
    except Exception:
        return False
    outputs = positions_of(first, out)
    return any(pos < len(outputs) and same_value(values[p], outputs[pos]) for pos in left)


def check_sliced_fails(analysis: Analysis, traces: list[str], e: Exception, k: int) -> None:
    """The step failed (`e`) to evaluate with arguments read as per-step by their leading axis
    alone, one slice a step; `traces` are those with which carried whole, as state, it
    evaluates and gives back their whole value at an open return position: such a one may be
    state whose first axis happens to be num_steps (an ensemble of 4 at num_steps=4, returned
    under a name that says nothing). The user says which, rather than read JAX's shape error
    about a slice they never asked for (it stays attached, as the context)."""
    if traces:
        first = (str(e).strip().splitlines() or [""])[0]
        raise error(
            ShapeError,
            SLICED_FAILS,
            analysis,
            param=traces[0],
            num_steps=k,
            error=f"{type(e).__name__}: {first[:200]}",
        )


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
    gives back one step's slice of it (or its whole shape, from the slice broadcast against
    another per-step input: an RNN's `h` of a batch of 4 at num_steps=4), and the same step
    with it carried whole (`carried`: that evaluation's positions) gives back its whole shape
    there, both readings type-check:
    per-step values mapped one by one, or state whose first axis happens to be num_steps
    (with shape (3,) at num_steps=4 it is matched as state). Either guess trains silently
    wrong when it is the other: the user says which."""
    for p, pos in places.items():
        rebuild, abstract = abstract_leaves(values[p], drop_axis=True)
        if same_value(rebuild(abstract), outputs[pos]):
            given = _SLICE
        elif same_value(values[p], outputs[pos]):
            given = _WHOLE  # (an RNN's hidden state of a batch of num_steps, `x @ wx + h @ wh`)
        else:
            continue
        whole = carried(p)
        if whole and same_value(values[p], whole[pos]):
            raise error(
                ShapeError, PER_STEP_OR_STATE, analysis, param=p, position=pos,
                num_steps=num_steps, given=given,
            )  # fmt: skip


def check_whole_per_step(
    analysis: Analysis,
    values: dict[str, Any],
    hits: dict[str, list[int]],
    carried: Callable[[str], list[Any] | None],
    num_steps: int,
) -> None:
    """An argument read as per-step by its leading axis alone (rule 10) that one step,
    reading it sliced, gives back with its whole structure and shapes at an open return
    position that looks like its new value (`hits`: computed from a contraction taking its
    own value, or under a name sharing a word with it), and that the same step, with
    it carried whole (`carried`: that evaluation's positions), gives back so there too: the
    hidden state of an RNN whose batch happens to be num_steps (each step's slice broadcast
    against the step's batch of 4 at num_steps=4), returned as an expression
    (`stop_gradient(h_new)`) or as a tuple or dict written in the return (`(h_new,
    c_new)`). Both readings type-check; sliced, each step would start from one row of the
    last chunk's carry: the user says which."""
    for p, at in hits.items():
        whole = carried(p) if at else None
        pos = next((pos for pos in at if whole and same_value(values[p], whole[pos])), None)
        if pos is not None:
            raise error(
                ShapeError, PER_STEP_OR_STATE, analysis, param=p, position=pos,
                num_steps=num_steps, given=_WHOLE,
            )  # fmt: skip


_SLICE = "a value with the structure, shapes and dtypes of one step's slice of it"
_WHOLE = (
    "a value with its whole shape computed from one step's slice of it (broadcast against "
    "another per-step input: a hidden state of a batch of num_steps examples)"
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
        if _all_leading(value, num_steps):
            line = dict(analysis.assigned_lines).get(p) or next(
                (ln for q, _, ln in analysis.in_place if q == p), analysis.def_line
            )
            raise error(
                ShapeError, WRITTEN_PER_STEP, analysis, param=p, line=line, num_steps=num_steps
            )


def check_returned_as_it_came_per_step(
    analysis: Analysis, options: Options, returned_at: dict[str, int], values: dict[str, Any],
    num_steps: int,
) -> None:  # fmt: skip
    """An argument returned by name is state; one the body neither binds again nor changes
    comes back as it came in, so as state each step would see the whole chunk. One whose
    array leaves all have a leading axis of num_steps is as likely a per-step input returned
    to log it (`return w, loss, x`): the user says which."""
    changed = analysis.rebound | analysis.assigned | {p for p, _, _ in analysis.in_place}
    for p, pos in returned_at.items():
        value = values[p]
        # A method of an object may change it (an array's, or a dict's other than those
        # `in_place` lists, do not).
        called = p in analysis.method_called and not (
            is_array(value) or type(value) in (dict, list, tuple)
        )
        if p in changed or called or p in options.explicit | options.state:
            continue
        if is_mutable_module(value):
            continue
        if _all_leading(value, num_steps):
            raise error(
                ShapeError, RETURNED_PER_STEP, analysis, param=p, pos=pos, num_steps=num_steps
            )


def check_rebound_per_step(
    analysis: Analysis,
    options: Options,
    returned_at: dict[str, int],
    values: dict[str, Any],
    num_steps: int,
    varying: Callable[[str], frozenset[str]],
    flow: Callable[[int], Flow],
) -> None:
    """An argument returned by name is state; one the body binds again from itself alone
    (the `flow` of its return position computed from none of the parameters `varying` gives
    for it, the per-step inputs and the other state) and then computes with (`Flow.reused`)
    is as likely a per-step input transformed, used and returned to log it (`x = x / 255.0`,
    the loss computed from it, `return w, x`), where every array has a leading axis of
    num_steps and some array is a float: carried, each step would see the whole chunk. The
    user says which. (State updated from a batch, an RNN's carry from its input, is computed
    from more; a decay or a count after use, `lrs = lrs * 0.99` for four ensemble members at
    num_steps=4, is only returned; per-environment keys and int counters hold no float.)"""
    for p, pos in returned_at.items():
        value = values[p]
        if p not in analysis.rebound or p in options.explicit | options.state:
            continue
        if is_mutable_module(value) or not _all_leading(value, num_steps):
            continue
        if not any(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree_util.tree_leaves(value)):
            continue
        here = flow(pos)
        if here.sources & varying(p) or not any(here.reused):
            continue
        raise error(ShapeError, REBOUND_PER_STEP, analysis, param=p, pos=pos, num_steps=num_steps)


def _all_leading(value: Any, num_steps: int) -> bool:
    """Every leaf an array with a leading axis of num_steps (and at least one leaf)."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(
        is_array(x) and np.ndim(x) >= 1 and np.shape(x)[0] == num_steps for x in leaves
    )


def raw_key_at_two(value: Any, num_steps: int) -> bool:
    """A raw `jax.random.PRNGKey` (uint32[2]) at num_steps=2, or a value holding one (a
    tuple, `*args`): its leading axis of 2 may be two steps' counts or one key, which sliced
    per step would give each step one uint32 (and JAX's key check would fail)."""
    return _raw_key_path(value, num_steps) is not None


def _raw_key_path(value: Any, num_steps: int) -> str | None:
    """Where `value` holds a raw PRNG key at num_steps=2 (`""`: it is one), or None."""
    if num_steps != 2:
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if is_key(leaf) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.tree_util.keystr(path)
    return None


def leading_axis_error(analysis: Analysis, p: str, value: Any, num_steps: int) -> Exception:
    """The error for an argument whose leading axes no rule settles (raised unless it is
    matched as state): a raw PRNG key at num_steps=2 (`raw_key_at_two`), or array leaves
    with and without a leading axis of num_steps (mixed)."""
    key_at = _raw_key_path(value, num_steps)
    if key_at is not None:
        return error(ShapeError, RAW_KEY_OR_PER_STEP, analysis, param=p, path=p + key_at)
    paths = jax.tree_util.tree_flatten_with_path(value)[0]
    bad = next(
        (path, leaf)
        for path, leaf in paths
        if not (is_array(leaf) and np.ndim(leaf) >= 1 and np.shape(leaf)[0] == num_steps)
    )
    star = next((q.kind for q in analysis.params if q.name == p), "")
    return error(
        ShapeError,
        MIXED_VARIADIC if star.startswith("var_") else MIXED_ARGUMENT,
        analysis,
        param=p,
        path=f"{p}{jax.tree_util.keystr(bad[0])}",
        shape=_shape_of(bad[1]),
        num_steps=num_steps,
        star="*" if star == "var_positional" else "**",
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
    axes, or a short first chunk. Where the step failed to evaluate (`cause`), the message
    quotes that error too: it may be the step's own, which no role mends (`lax.pmean` with
    no `pmap` around the step)."""
    found = next((deferred[p] for p in kinds if p in deferred), None)
    if found is None and num_steps > 1:
        found = _short_first_chunk(analysis, kinds, values, num_steps, options)
    if found is None:
        return
    if cause is not None:
        first = (str(cause).strip().splitlines() or [""])[0][:300]
        found = type(found)(
            f"{found}\nOne step, evaluated with it as the same for every step, raised "
            f"{type(cause).__name__}: {first} (the error above this one). If that is the "
            "step's own error, no role mends it: fix the step."
        )
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
        if role != "broadcast" or p in options.bound or p in options.broadcast:
            continue  # (what a partial binds, or `broadcast=` names, is the same every step)
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


def note_per_step_by_shape(e: BaseException, names: Sequence[str], num_steps: int) -> None:
    """Add to the step's own error `e` that `names` were read per-step by their leading axis
    alone (rule `leading-axis`), with the `broadcast=` that says otherwise: a full batch
    whose length is `num_steps` fails in the step as a bare indexing error."""
    if not names or num_steps == 1 or not isinstance(e, Exception):
        return
    one = len(names) == 1
    note = PER_STEP_BY_SHAPE_NOTE.format(
        names=", ".join(f"`{n}`" for n in names),
        num_steps=num_steps,
        them="it" if one else "each",
        which="its being" if one else "one of them being",
        declared=repr(names[0]) if one else "<its name>",
    )
    if note not in getattr(e, "__notes__", ()):
        e.add_note(note)


def refuse_nested_modules(
    analysis: Analysis,
    fn: Callable[..., Any],
    kinds: dict[str, Role],
    written_back: tuple[str, ...],
    values: dict[str, Any],
    n: int,
) -> None:
    """A Flax NNX object inside an argument that is not given back (`def step(*objs)` called
    with `(model, optimizer, x, y)`, a metric in a dict the body writes into) that the body
    changes in place: the change would be lost, where it is written back into one passed as
    an argument of its own. One the body only reads (an ensemble, a teacher) is fine: an
    abstract evaluation tells them apart (`abstract.changes_inside`). `kinds`: every
    parameter's role, in order; `written_back`: the state not returned."""
    params = tuple(kinds)
    for p, role in kinds.items():
        given_back = role == "state" and p not in written_back
        found = None if given_back else nested_module(values[p])
        if found is not None and changes_inside(fn, params, values, kinds, n, p):
            raise error(
                StateError,
                NNX_NESTED,
                analysis,
                param=p,
                path=f"{p}{found[0]}",
                cls=found[1].__class__.__qualname__,
                role=_ROLE_WORDS.get(role, role),
            )


_ROLE_WORDS = {
    "scanned": "a per-step input, not state",
    "broadcast": "broadcast, not state",
    "static": "static, not state",
    "state": "state written back into your object",
}
