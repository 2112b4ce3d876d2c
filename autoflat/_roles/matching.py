"""State by abstract value (`_infer`'s stage 2 at the first call): which return position gives
back which parameter.

`match` pairs candidate parameters with return positions whose abstract value (tree
structure, shapes, dtypes) equals theirs: a container anywhere, a bare array only at its own
place among the parameters that can come back through a return (`places`), a PRNG key also
where nothing else fits (`is_key`). Parameters alike are settled by the step's data flow,
then by names (`settle_alike`; the word rules are `names`'s); Python numbers given back
changed at their place are counters (`counters`). A single `return f(...)` giving a tuple
or a dict can be taken item by item (`unpackable`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis, Return
from .._errors import (
    AMBIGUOUS_STATE,
    ARRAY_AT_ITS_PLACE,
    RETURNS_DISAGREE,
    AutoflatError,
    OptionError,
    SourceError,
    error,
)
from .._transport.structure import attribute, is_array
from .abstract import is_copy, same_value
from .flow import Flow
from .names import extreme_named, name_at, named_after, named_for, renamed, tokens


def match(
    analysis: Analysis,
    params: tuple[str, ...],
    values: dict[str, Any],
    candidates: list[str],
    positions: list[int],
    outputs: list[Any],
    declared: set[str],
    place: dict[str, int],
    alike: Callable[..., dict[str, tuple[int, str]] | None],
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
    gradients: dict[int, set[str]],
) -> dict[str, tuple[int, str]]:
    """Return positions matched to candidate parameters by abstract value.

    `place` (`_places`) gives the parameters that could be state their own return position:
    a bare array may only match there, and only where the step's data flow (`flow`, per
    position: the parameters it is computed from, those the last operation takes) says it
    could be its new value (`bare_at_place`); never where it returns gradients taken at it
    (`gradients`). `alike(left, spots, fits)` settles several parameters alike over as many
    positions (`settle_alike`), or returns None."""
    if not outputs:
        return {}
    fits = _fits(
        analysis, values, candidates, positions, outputs, declared, place, flow, names, gradients
    )
    copies = _first_of_copies(fits, outputs)  # per parameter, a note on the others
    matched = _settle_singles(fits, copies)
    left = sorted((p for p, ps in fits.items() if ps and p not in matched), key=params.index)
    if left:
        spots = sorted({pos for p in left for pos in fits[p]})
        settled = alike(left, spots, fits)
        if settled is None:
            raise _ambiguous(analysis, left, spots)
        matched.update(settled)
    return matched


def _fits(
    analysis: Analysis,
    values: dict[str, Any],
    candidates: list[str],
    positions: list[int],
    outputs: list[Any],
    declared: set[str],
    place: dict[str, int],
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
    gradients: dict[int, set[str]],
) -> dict[str, list[int]]:
    """Per candidate parameter, the return positions whose abstract value it could be."""
    fits: dict[str, list[int]] = {}
    for p in candidates:
        bare = jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(values[p]))
        fits[p] = [
            pos
            for pos in positions
            if (not bare or p in declared or pos == place.get(p))
            and p not in gradients.get(pos, ())
            and same_value(values[p], outputs[pos])
        ]
        if bare and p not in declared and not is_key(values[p]) and fits[p]:
            fits[p] = bare_at_place(analysis, p, fits[p][0], flow, names, place)
    # A carried PRNG key returned at another position (`return state, metrics, new_rng`):
    # matched where no other candidate fits. Several keys: each at any position its value
    # fits, settled below by data flow (the rank put `noise_rng` on `new_dropout_rng`).
    keys = [p for p in candidates if is_key(values[p])]
    fitted = {pos for p, ps in fits.items() if p not in keys for pos in ps}
    for p in keys:
        if len(keys) > 1 or not fits[p]:
            fits[p] = [
                pos
                for pos in positions
                if pos not in fitted and same_value(values[p], outputs[pos])
            ]
    return fits


def _settle_singles(
    fits: dict[str, list[int]], copies: dict[str, str]
) -> dict[str, tuple[int, str]]:
    """One parameter for one position: settled, that position taken from the others' fits
    (`fits` is narrowed in place); repeated while that frees others."""
    matched: dict[str, tuple[int, str]] = {}
    changed = True
    while changed:
        changed = False
        for p, ps in fits.items():
            if p in matched or len(ps) != 1:
                continue
            others = [q for q, qs in fits.items() if q != p and q not in matched and ps[0] in qs]
            if not others:
                matched[p] = (ps[0], f"matched by value to return position {ps[0]}{copies[p]}")
                for q in fits:
                    if q not in matched:
                        fits[q] = [pos for pos in fits[q] if pos != ps[0]]
                changed = True
    return matched


def _ambiguous(analysis: Analysis, left: list[str], spots: list[int]) -> AutoflatError:
    """The error for parameters that several return positions could each be state for."""
    listed = ", ".join(f"`{q}`" for q in left)
    if len(spots) == 1:
        either = " or ".join(f"`{q}`" for q in left)
        what = f"return position {spots[0]} could be the new value of {either}"
    elif len(left) == 1:
        what = f"return positions {', '.join(map(str, spots))} each look like {listed}"
    else:
        what = (
            f"return positions {', '.join(map(str, spots))} could each be the new value of {listed}"
        )
    example = ", ".join(f'"{q}": <position>' for q in left)
    return error(
        OptionError,
        AMBIGUOUS_STATE,
        analysis,
        what=what,
        example=example,
        by_name=_by_name(analysis),
    )


def _first_of_copies(fits: dict[str, list[int]], outputs: list[Any]) -> dict[str, str]:
    """A parameter whose value fits several positions that give back the very same value
    (`return {"params": p, "log": p}`: a trajectory logged) fits the first of them, as
    `return p, p` gives it back at the first (rule 2); the others are per-step outputs. Per
    parameter, what its evidence adds: those others, or nothing."""
    notes = dict.fromkeys(fits, "")
    for p, ps in fits.items():
        if len(ps) > 1 and all(is_copy(outputs[ps[0]], outputs[q]) for q in ps[1:]):
            fits[p] = ps[:1]
            s = "s" if len(ps) > 2 else ""
            listed = ", ".join(f"return position {q}" for q in ps[1:])
            gives = "give" if s else "gives"
            notes[p] = f"; {listed} {gives} back the same value: a per-step output{s}"
    return notes


def bare_at_place(
    analysis: Analysis,
    p: str,
    pos: int,
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
    place: dict[str, int],
) -> list[int]:
    """`[pos]` if the bare array `p` is state at its place `pos`, else an OptionError.
    (Where another position is made by an operation taking `p` itself, the returns may be
    in another order than the parameters: the error says which `state=` that reading is.) Its
    rank among the parameters is weak evidence: `(params, opt_state, x, lr)` returning
    `params, opt_state, loss` put `lr` at the loss's place, and at num_steps=4 every step
    trained with the previous loss as its learning rate, silently. So more must agree: the
    last operation takes `p`'s own array, or it times a constant (`w - lr * g`, `step + 1`,
    `mn = 0.9 * m + 0.1 * g`), or the returned name
    shares a word with `p` (`new_v`, `v2`, `loss` for `prev_loss`), or the return is an
    expression computed from `p` (`0.9 * v + g`). Else nothing tells a learning rate beside
    a loss from a previous loss overwritten every step: the user says which."""
    if linked(p, pos, flow, names):
        return [pos]
    sources = flow()[pos].sources
    name = name_at(names, pos)
    returned = f"`{name}`" if name is not None else "an expression"
    if _extreme_only(p, flow()[pos]):
        link = (
            f"It is a maximum or a minimum taking `{p}` (or a clip by it, or a select by a "
            f"comparison with it), which the step only returns: a running best "
            f"(`jnp.minimum(best, loss)`) or a value clamped by a fixed bound "
            f"(`jnp.maximum(floor, loss)`), and "
            + (
                f"`{name}` is neither `{p}` nor `new_{p}` and shares no word for a running "
                f"extreme with it (`best`, `max`, `min`)"
                if name
                else "no name says which"
            )
        )
    elif _picked_renamed(p, pos, flow, names):
        link = (
            f"It is `{p}` times a factor the step picks among constants (a warmup or a step "
            f"schedule, `{p} * jnp.where(step < n, 0.1, 1.0)`), under a name of its own: the "
            f"`{p}` this step used, given back to be logged, or the next step's `{p}`"
        )
    elif p in sources:
        link = (
            f"It is computed from `{p}`, but neither its name nor its last operation says it "
            f"is `{p}`'s new value"
        )
    else:
        link = "Nothing else in the step links them"
    raise error(
        OptionError,
        ARRAY_AT_ITS_PLACE,
        analysis,
        pos=pos,
        returned=returned,
        how="computed from" if p in sources else "not computed from",
        param=p,
        link=link,
        reordered=_reordered(p, pos, flow, names, place),
    )


def _reordered(
    p: str,
    pos: int,
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
    place: dict[str, int],
) -> str:
    """The error's note for returns in another order than the parameters (`return p, v1,
    m1` for `(p, m, v)`): the one other position computed from `p` and made by an operation
    taking `p` itself or named after it, and where the parameter at that place went; or
    nothing."""
    flows = flow()

    def new_value(q: str, j: int) -> bool:
        here = flows[j]
        return q in here.direct or (q in here.sources and named_after(q, j, names))

    made = [j for j in range(len(flows)) if j != pos and new_value(p, j)]
    if len(made) != 1:
        return ""
    j = made[0]
    state = {p: j}
    there = [q for q, at in place.items() if at == j and q != p]
    if there and new_value(there[0], pos):
        state[there[0]] = pos  # swapped
    shown = ", ".join(f'"{q}": {at}' for q, at in state.items())
    name = name_at(names, j) or "an expression"
    return (
        f"\nReturn position {j} (`{name}`) is computed from `{p}` and looks like its new "
        f"value: if it is (the returns in another order than the parameters), say "
        f"so:\n\n    @autoflat.step(..., state={{{shown}}})\n"
    )


def linked(
    p: str,
    pos: int,
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
) -> bool:
    """Whether more than its place says return position `pos` may be the new value of the
    bare array `p`: the last operation making it takes `p`'s array (`w - lr * g`), or its
    name is `p`'s new one (`named_for`: `new_v`, `v2`, `loss` for `prev_loss`; not `kl` for
    `kl_weight`), or it is an expression computed from `p`
    (`jnp.clip(v + g, -1, 1)`) that does not weigh it by another value (`kd * temp**2`
    logs a loss weighed by `temp`: `flow.Weight`). Not `p` times a factor the step picks
    given back under a name of its own (`_picked_renamed`), nor a maximum or a minimum
    taking `p` (`_extreme_only`: a running `best` or a clamp's `floor`) unless the name says
    which (`named_for`, or a shared word for an extreme: `names.extreme_named`)."""
    if _picked_renamed(p, pos, flow, names):
        return False
    here = flow()[pos]
    if named_for(p, pos, names):
        return True
    if _extreme_only(p, here):
        return extreme_named(p, pos, names)
    if p in here.direct:
        return True
    weighed = any(w.param == p and w.by - {p} for ws in here.weighted for w in ws)
    return name_at(names, pos) is None and p in here.sources and not weighed


def _extreme_only(p: str, here: Flow) -> bool:
    """Whether the position is a maximum or a minimum taking `p`'s array as it came
    (`Flow.extremes`) that the step only returns: a clamped loss logged (`jnp.maximum(floor,
    loss)`) looks like a running best (`jnp.minimum(best, loss)`). One the step computes with
    (`Flow.reused`: AMSGrad's `v_hat_t = jnp.maximum(v_hat, v_t)` in the update) is a value
    it carries on."""
    return any(p in taken for taken in here.extremes) and not any(here.reused)


def _picked_renamed(
    p: str, pos: int, flow: Callable[[], list[Flow]], names: tuple[str | None, ...]
) -> bool:
    """Whether return position `pos` is the bare array `p` times a factor the data picks
    among constants (`Flow.picked`), which the step also computes with (`Flow.reused`),
    under a name other than `p`'s or its new value's (`renamed`): `lr_t = lr *
    jnp.where(step < 2, 0.1, 1.0)` used in the update, the warmed-up rate this step used,
    logged, or a step schedule's next rate; `lr = lr * jnp.where(...)` and `new_lr` say
    which, and a value only returned (`decayed_lr`, `loss_scale`) is the next one."""
    here = flow()[pos]
    return (
        here.picked == (p,)
        and here.reused == (True,)
        and name_at(names, pos) is not None
        and not renamed(p, pos, names)
    )


def _by_name(analysis: Analysis) -> str:
    """For AMBIGUOUS_STATE: that the step returns no parameter by name, where that is so."""
    params = analysis.param_names
    if any(name in params for r in analysis.returns for name in r.names):
        return ""
    return ", and the step does not return its state by name"


def settle_alike(
    left: list[str],
    spots: list[int],
    fits: dict[str, list[int]],
    *,
    names: tuple[str | None, ...],
    flow: Callable[[], list[Flow]],
) -> dict[str, tuple[int, str]] | None:
    """Parameters alike (`ema_params, params`; a GAN's two models of one shape; an online and
    a target network) over positions alike: of the ways to give the positions to as many
    parameters, the one under which each position is computed from its parameter (the step's
    data flow; of several, the one where each position's last operation takes its
    parameter's own arrays, `online + updates` beside a target network read in the loss),
    else the one whose returned names share most words with the parameters' (`new_ema` and
    `ema_params`), else None: parameter order is no evidence (`return new_params, new_ema`
    for `(ema_params, params)` trained silently wrong). Positions left over are per-step
    outputs; parameters left over are broadcast."""
    if len(spots) > 6 or len(left) > 6:
        return None
    n = min(len(left), len(spots))
    options = [
        tuple(zip(who, where, strict=True))
        for who in itertools.permutations(left, n)
        for where in itertools.combinations(spots, n)
        if all(pos in fits[p] for p, pos in zip(who, where, strict=True))
    ]
    sources = flow()
    flowing = [a for a in options if all(p in sources[pos][0] for p, pos in a)]
    if len(flowing) > 1:
        # Each computed from several: the one where each position's last operation takes
        # its parameter's own arrays (`online + updates`, beside a target net in the loss).
        near = [a for a in flowing if all(p in sources[pos][1] for p, pos in a)]
        flowing = near if len(near) == 1 else flowing
    if len(flowing) == 1:
        return {
            p: (pos, f"matched by value and data flow to return position {pos}")
            for p, pos in flowing[0]
        }

    def shared(a: tuple[tuple[str, int], ...]) -> int:
        return sum(len(tokens(p) & tokens(names[pos] or "")) for p, pos in a)

    scored = sorted(((shared(a), a) for a in flowing or options), reverse=True)
    if scored and scored[0][0] > 0 and (len(scored) == 1 or scored[1][0] < scored[0][0]):
        return {
            p: (pos, f"matched by value and name to return position {pos}")
            for p, pos in scored[0][1]
        }
    return None


def disagree(analysis: Analysis, p: str, pos: int) -> Exception:
    """`p` returned by name at `pos` in some returns, and something else there in others."""
    returns = analysis.returns
    named = next(r for r in returns if pos < len(r.names) and r.names[pos] == p)
    other = next(r for r in returns if pos < len(r.names) and r.names[pos] != p)
    return error(
        SourceError, RETURNS_DISAGREE, analysis, first=named.describe(), second=other.describe()
    )


def places(carried: list[str], returned: Return) -> dict[str, int]:
    """Each parameter that could be state, in order, with its own return position: its rank
    among them, or for a returned dict the key that is its name (`"step": step + 1`)."""
    if returned.keys:
        return {p: returned.keys.index(p) for p in carried if p in returned.keys}
    return {p: i for i, p in enumerate(carried)}


def unpackable(out: Any) -> bool:
    """A tuple (a NamedTuple too: jaxopt's `OptStep`), or a dict keyed by strings or ints
    (keys the generated code can spell)."""
    if type(out) is tuple or named_tuple(out) is not None:
        return True
    return type(out) is dict and all(type(k) in (str, int) for k in out)


def named_tuple(out: Any) -> type | None:
    """The NamedTuple class of `out`, or None."""
    t = type(out)
    return t if isinstance(out, tuple) and isinstance(getattr(t, "_fields", None), tuple) else None


def is_key(value: Any) -> bool:
    """A PRNG key (a typed key, or a raw `uint32[2]` one): a carried key returned at another
    position (`return state, metrics, new_dropout_rng`) is matched wherever it is."""
    dtype = attribute(value, "dtype")
    if dtype is None or not is_array(value):
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.uint32 and np.shape(value) == (2,)
