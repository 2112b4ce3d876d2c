"""One step's data flow, read off its jaxpr: where each return position's arrays come from.

`flows` traces one step (each argument as its role gives it, as `abstract.eval_one_step`
does) and walks the jaxpr (`_walk`), into the jaxprs that calls hold: per return position, a
`Flow` of the parameters its arrays are computed from, those whose own arrays the last
operation making it takes (`p - lr * g`, `total + loss`), per leaf the parameter it is an own
leaf of (given back as it came, through casts and reshapes), and the parameters it is
computed from other than through reductions alone (`Flow.smooth`). Computed-from is an
over-approximation: every output of an operation counts as computed from all of its inputs.
State matching reads it (`matching`, `state_hazards`, `scalars`, `infer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _jax
from .._transport.structure import is_array
from .abstract import arguments, one_step_call, traced_on_failure
from .options import Role


class Flow(NamedTuple):
    """Where one return position's arrays come from (`flows`): the parameters they are
    computed from, those whose own arrays are operands of the last operation making them,
    and per leaf (in `tree_leaves` order) the parameters that leaf is computed from, the
    parameter it is an own leaf of, given back as it came (`x` in `(h, x)`), or None, the
    parameters it is computed from other than through a reduction alone (`smooth`: a
    mean or a norm of something computed from `mu` is not; `0.9 * ema + 0.1 * loss` is
    from `ema`), the weights it sums (`weighted`: `alpha * kd` in `alpha * kd + ce`), the
    parameters whose own leaves the last operation making it takes (`takes`), and the leaves
    of containers of scalar arrays it is computed from (`origins`: `(p, j)` for leaf `j` of
    `p`; `gamma` of `(gamma, alpha)`, not `alpha`, in a TD error `r + gamma * v[s2] - v[s]`),
    the parameter it is an own leaf of times a factor the data picks among constants
    (`picked`: `lr * jnp.where(step < warmup, 0.1, 1.0)`, `jnp.where(step < 2, lr * 0.1,
    lr)`), or None, whether the step also computes other values from it (`reused`: `lr_t`
    in `w - lr_t * g`), and the parameters whose own leaves a last operation that is a
    maximum or a minimum takes (`extremes`: `best` in `jnp.maximum(best, loss)`, a running
    maximum, and `floor` in `jnp.maximum(floor, loss)`, a clamp: only a name tells them
    apart), and the parameters whose own leaf is an operand of a contraction it is computed
    from, a product summed over an axis (`mixed`: `h` in `jnp.tanh(x @ wx + h @ wh)`, not
    `beta` in `beta * per_example`).
    """

    sources: frozenset[str]
    direct: frozenset[str]
    leaves: tuple[frozenset[str], ...]
    owners: tuple[str | None, ...]  # per leaf, the parameter it is the own leaf of
    smooth: tuple[frozenset[str], ...]
    weighted: tuple[frozenset[Weight], ...]
    takes: tuple[frozenset[str], ...]  # per leaf, `direct` (not a leaf given back as it came)
    origins: tuple[frozenset[Origin], ...]
    picked: tuple[str | None, ...]
    reused: tuple[bool, ...]
    extremes: tuple[frozenset[str], ...]
    mixed: frozenset[str]


# The operations that accumulate, their first operand the running value (`flows_traced`,
# `flows(additions=True)`). Not a maximum: `jnp.maximum(best, acc)` is a running maximum, but
# `jnp.maximum(floor, loss)` a clamp.
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
    return traced_on_failure(attempt, values, roles)


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
    parts, call = one_step_call(fn, params, values, roles, num_steps, scalars)
    kinds: list[list[bool]] = []  # per position, per leaf: traced (else a constant)

    def one_step(arrays: list[list[Any]]) -> Any:
        args = arguments(parts, arrays)
        outs = []
        for item in split(call(args)):
            leaves = jax.tree_util.tree_leaves(item)
            kinds.append([_jax.is_tracer(x) for x in leaves])
            outs += [x for x in leaves if _jax.is_tracer(x)]
        return outs

    inputs = [[] if rebuild is None else a for rebuild, a in parts]
    jaxpr = jax.make_jaxpr(one_step)(inputs).jaxpr
    seeds = [
        _Var(
            frozenset({p}),
            root=p,
            smooth=frozenset({p}),
            origins=frozenset({(p, j)}) if scalar_container(values[p]) else _NO_ORIGINS,
        )
        for p, a in zip(params, inputs, strict=True)
        for j, _ in enumerate(a)
    ]
    walked = _walk(jaxpr, seeds, last)
    reused = _reused(jaxpr)
    result = []
    at = 0
    for traced in kinds:
        span = range(at, at + sum(traced))
        at += len(span)
        index = iter(span)
        at_leaf = [next(index) if t else None for t in traced]
        result.append(
            Flow(
                _NONE.union(*(walked[i].sources for i in span)),
                _NONE.union(*(walked[i].direct | _own(walked[i].root) for i in span)),
                tuple(_NONE if i is None else walked[i].sources for i in at_leaf),
                tuple(None if i is None else walked[i].root for i in at_leaf),
                tuple(_NONE if i is None else walked[i].smooth for i in at_leaf),
                tuple(frozenset() if i is None else walked[i].weighted for i in at_leaf),
                tuple(_NONE if i is None else walked[i].direct for i in at_leaf),
                tuple(_NO_ORIGINS if i is None else walked[i].origins for i in at_leaf),
                tuple(
                    None if i is None or not walked[i].picked else walked[i].scaled for i in at_leaf
                ),
                tuple(i is not None and reused[i] for i in at_leaf),
                tuple(_NONE if i is None else walked[i].extreme for i in at_leaf),
                _NONE.union(*(walked[i].mixed for i in span)),
            )
        )
    return result


def _reused(jaxpr: Any) -> list[bool]:
    """Per output of `jaxpr`, whether an operation of it takes that output (or what a cast or
    reshape made it from) as an operand: a value the step computes with, not only returns."""
    taken = {v for eqn in _jax.equations(jaxpr) for v in _jax.inputs(eqn) if not _jax.is_literal(v)}
    made_from = {
        out: _jax.inputs(eqn)[0]
        for eqn in _jax.equations(jaxpr)
        if _jax.name(eqn) in _PASS_THROUGH
        for out in _jax.outputs(eqn)
    }
    return [
        not _jax.is_literal(v) and (v in taken or made_from.get(v) in taken)
        for v in _jax.outputs(jaxpr)
    ]


def scalar_container(value: Any) -> bool:
    """Whether a value is a container of scalar arrays only (`(count, total)`, `(mu, sd)`)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return (
        bool(leaves)
        and not jax.tree_util.treedef_is_leaf(treedef)
        and all(is_array(x) and not np.shape(x) for x in leaves)
    )


_NONE: frozenset[str] = frozenset()


def _own(root: str | None) -> frozenset[str]:
    return _NONE if root is None else frozenset({root})


# A leaf of a container of scalar arrays: (parameter, index among its leaves) (`Flow.origins`).
Origin = tuple[str, int]
_NO_ORIGINS: frozenset[Origin] = frozenset()


class Weight(NamedTuple):
    """A term of a sum that is a parameter's own leaf times, or over, a value computed from
    others (`alpha * kd`, `loss / scale`, `max_norm / gnorm`): how a hyperparameter weighs
    a loss, where a running value is kept otherwise (`0.9 * ema + 0.1 * loss`)."""

    param: str
    by: frozenset[str]  # the parameters the value weighed by is computed from
    # The product of the parameter's own leaf, or of a value of it alone (`jnp.exp(log_w)`,
    # `w / (w + v)`), and the value, or one over the other, nothing added since (`w_ce *
    # ce`, `loss / scale`; not `d * ema + (1 - d) * loss`, nor a Welford mean: `_bare`)
    bare: bool = False


class _Var(NamedTuple):
    """What `_walk` knows of one variable of a jaxpr: the parameters it is computed from,
    those whose own leaves the operation making it takes, the parameter it is the own leaf
    of (through casts and reshapes), the parameters it is computed from other than through
    reductions alone (`Flow.smooth`), of those the ones spread over more elements by a
    broadcast on the way (`mu` in `x - mu`): what a reduction then reduces, and the
    parameter it is an own leaf of times a constant (`0.9 * m`, `-v`, `m / 2`, `lr *
    jnp.where(better, 1.05, 0.5)`): an operation taking it takes that leaf (`0.9 * m + 0.1 *
    g`, an average kept as Adam keeps its moments), whether it is one of a few constants that
    the data only picks between (`stepwise`: `jnp.where(finite, 2.0, 0.5)`), and the weights
    it sums (`Flow.weighted`), the leaves of containers of scalar arrays it is computed
    from (`Flow.origins`), and whether a factor of its multiple is one the data picks
    (`picked`: `lr * jnp.where(step < 2, 0.1, 1.0)`, not `0.9 * m`), and the parameters
    whose own leaves the operation making it takes if it is a maximum or a minimum
    (`Flow.extremes`), and for a predicate, the parameters whose own leaves a comparison
    making it takes (`loss < floor`: `floor`), and the parameters whose own leaf is an
    operand of a contraction it is computed from (`Flow.mixed`)."""

    sources: frozenset[str] = _NONE
    direct: frozenset[str] = _NONE
    root: str | None = None
    smooth: frozenset[str] = _NONE
    spread: frozenset[str] = _NONE
    scaled: str | None = None
    stepwise: bool = False
    weighted: frozenset[Weight] = frozenset()
    origins: frozenset[Origin] = _NO_ORIGINS
    picked: bool = False
    extreme: frozenset[str] = _NONE
    compared: frozenset[str] = _NONE
    mixed: frozenset[str] = _NONE


_LITERAL = _Var()


def _walk(jaxpr: Any, ins: list[_Var], last: frozenset[str] | None = None) -> list[_Var]:
    """Per output of `jaxpr`, given what is known of its inputs, what is known of it
    (`_Var`). Every output of an operation counts as computed from all of its inputs. A call
    of a jaxpr (a `jax.jit`-ed helper, a custom derivative, a remat, a scan's body) is walked
    into, and so are a `cond`'s branches (`_branches`) and a while loop's body (`_while`);
    another operation holding jaxprs takes no operand directly and reduces none. Given
    `last` (additions), only an operation of those names takes an operand directly, and only
    its first."""
    known = {
        v: x._replace(direct=_NONE, extreme=_NONE)
        for v, x in zip(_jax.inputs(jaxpr), ins, strict=True)
    }

    def get(v: Any) -> _Var:
        return _LITERAL if _jax.is_literal(v) else known.get(v, _LITERAL)

    for eqn in _jax.equations(jaxpr):
        if not _jax.outputs(eqn):
            continue  # (a callback that returns nothing: `jax.debug.print`)
        got = [get(v) for v in _jax.inputs(eqn)]
        inner = _jax.called_jaxpr(eqn)
        branches = _jax.branches(eqn)
        loop = _jax.while_loop(eqn)
        if inner is not None:
            outs = _walk(inner, got, last)
        elif branches:
            outs = _branches(branches, got, last)
        elif loop is not None:
            outs = _while(loop, got, last)
        else:
            outs = _operation(eqn, got, last)
        known.update(zip(_jax.outputs(eqn), outs, strict=True))
    return [get(v) for v in _jax.outputs(jaxpr)]


def _branches(branches: list[Any], got: list[_Var], last: frozenset[str] | None) -> list[_Var]:
    """A `cond`'s outputs: computed from what the index and some branch computes them from;
    no operand taken directly, and no own leaf (as before the branches were walked)."""
    index, operands = got[0], got[1:]
    walked = [_walk(branch, operands, last) for branch in branches]
    return [
        _Var(
            index.sources.union(*(x.sources for x in per)),
            smooth=index.smooth.union(*(x.smooth for x in per)),
            spread=index.spread.union(*(x.spread for x in per)),
            origins=index.origins.union(*(x.origins for x in per)),
            mixed=index.mixed.union(*(x.mixed for x in per)),
        )
        for per in zip(*walked, strict=True)
    ]


def _while(
    loop: tuple[Any, Any, int, int], got: list[_Var], last: frozenset[str] | None
) -> list[_Var]:
    """A while loop's outputs: its carry, walked through the body until what is known of it
    settles (it only grows), joined with what the condition reads (it decides how many times
    the body runs); no operand taken directly, and no own leaf. A loop that does not settle
    within `_LOOP_WALKS` walks is taken as computing every output from every input."""
    cond, body, n_cond, n_body = loop
    cond_consts, body_consts = got[:n_cond], got[n_cond : n_cond + n_body]
    carry = [_joined(x) for x in got[n_cond + n_body :]]
    for _ in range(_LOOP_WALKS):
        walked = _walk(body, body_consts + carry, last)
        after = [_joined(a, b) for a, b in zip(carry, walked, strict=True)]
        if after == carry:
            (decides,) = _walk(cond, cond_consts + carry, last)
            return [_joined(x, decides) for x in carry]
        carry = after
    return [_joined(*got)] * len(carry)


# The walks of a while loop's body after which `_while` stops following its carry.
_LOOP_WALKS = 8


def _joined(*xs: _Var) -> _Var:
    """What is known of a value computed from all of `xs` (no operand taken directly)."""
    return _Var(
        _NONE.union(*(x.sources for x in xs)),
        smooth=_NONE.union(*(x.smooth for x in xs)),
        spread=_NONE.union(*(x.spread for x in xs)),
        origins=_NO_ORIGINS.union(*(x.origins for x in xs)),
        mixed=_NONE.union(*(x.mixed for x in xs)),
    )


def _operation(eqn: Any, got: list[_Var], last: frozenset[str] | None) -> list[_Var]:
    """The outputs of one operation that holds no jaxpr it calls (`_walk`)."""
    ins = [(v, x) for v, x in zip(_jax.inputs(eqn), got, strict=True) if not _jax.is_literal(v)]
    if last is None:
        operands = [] if _jax.holds_jaxprs(eqn) else [x for _, x in ins]
    else:
        # An accumulation's own value is its first operand (`total + loss`, `t - 1`):
        # `loss + beta` and `loss - f_star` do not accumulate `beta` or `f_star`.
        first = list(_jax.inputs(eqn)[:1])
        takes = _jax.name(eqn) in last and first and not _jax.is_literal(first[0])
        operands = got[:1] if takes else []
    name = _jax.name(eqn)
    through = name in _PASS_THROUGH and len(ins) == 1
    smooth, spread = _reduced(eqn, ins)
    passes = through or _broadcast(name, ins)
    scaled = _own_leaf(ins[0][1]) if passes else _scaled(name, got)
    if name in _SCALINGS and _size(_jax.out_aval(eqn)) == 1:
        # (a scalar product takes an operand's leaf only as a multiple of it, `0.9 * m`:
        # `wd * reg` weighs `wd`, it does not update it; `w * jnp.exp(-eta * losses)` does)
        operands = [x for x in operands if _own_leaf(x) == scaled]
    direct = frozenset(own for x in operands if (own := _own_leaf(x)) is not None)
    if name == "sharding_constraint" and len(ins) == 1:
        # (`eqx.filter_shard(p + u, ...)` still takes `p`; not a cast or a reshape: a residual
        # `(pred - target).astype(bf16)` or a bfloat16 gradient cast back takes no new value)
        direct |= ins[0][1].direct
    out = _Var(
        _NONE.union(*(x.sources for _, x in ins)),
        direct,
        ins[0][1].root if through else None,
        smooth,
        spread,
        scaled,
        _stepwise(name, got),
        _weighted(name, got),
        _NO_ORIGINS.union(*(x.origins for _, x in ins)),
        scaled is not None and (ins[0][1].picked if passes else _picked(name, got)),
        _extreme(name, got),
        _compared(name, got),
        _mixed(name, [x for _, x in ins]),
    )
    return [out] * len(_jax.outputs(eqn))


def _mixed(name: str, ins: list[_Var]) -> frozenset[str]:
    """`_Var.mixed`: the operands' own, and for a contraction the parameters whose own leaf
    (through casts and reshapes) is one of its operands (`h @ wh`; not `(x + style) @ w`, a
    per-step input shifted, nor `x @ w_new`, a model updated by a per-step schedule)."""
    got = _NONE.union(*(x.mixed for x in ins))
    if name in _CONTRACTIONS:
        got = got.union(*(_own(x.root) for x in ins))
    return got


# The operations that sum over an axis of their operands (`Flow.mixed`).
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def _extreme(name: str, got: list[_Var]) -> frozenset[str]:
    """`_Var.extreme`: the own leaves a maximum or a minimum takes as they came (a clamp's
    bound; not `0.999 * u`, AdaMax's decayed own value), and those its operands took so
    (`jnp.clip(loss, lo, hi)`, a minimum of a maximum); or the own leaf a select gives whose
    predicate compares it (`jnp.where(loss < floor, floor, loss)`, `jnp.fmax(floor,
    loss)`)."""
    if name in _EXTREMES:
        owns = {x.root for x in got if x.root is not None}
        return frozenset(owns).union(*(x.extreme for x in got))
    if name == "select_n" and len(got) > 2:
        owns = {x.root for x in got[1:] if x.root is not None}
        return frozenset(p for p in owns if p in got[0].compared)
    return _NONE


def _compared(name: str, got: list[_Var]) -> frozenset[str]:
    """`_Var.compared`: the own leaves a comparison takes, through the casts and logic of
    predicates (`jnp.fmax`'s `(b > a) | (a != a)`)."""
    if name in _COMPARISONS:
        return frozenset(own for x in got if (own := _own_leaf(x)) is not None)
    if name in _LOGIC:
        return _NONE.union(*(x.compared for x in got))
    return _NONE


_COMPARISONS = frozenset({"lt", "le", "gt", "ge"})
_LOGIC = frozenset({"and", "or", "not", "convert_element_type"})


_EXTREMES = frozenset({"max", "min", "clamp"})


def _broadcast(name: str, ins: list[tuple[Any, _Var]]) -> bool:
    return name == "broadcast_in_dim" and len(ins) == 1


def _own_leaf(x: _Var) -> str | None:
    """The parameter whose own leaf `x` is, or is a constant multiple of."""
    return x.root or x.scaled


def _fixed(x: _Var) -> bool:
    """Whether `x` is a constant, or one of a few that the data only picks between."""
    return not x.sources or x.stepwise


def _scaled(name: str, got: list[_Var]) -> str | None:
    """The parameter whose own leaf (`_Var.root`) an operation's output is a constant
    multiple of: a product or quotient of it and constants, or values the data only picks
    between (`0.9 * m`, `m / 2`, `lr * jnp.where(better, 1.05, 0.5)`), or its negation, or a
    select between such multiples of it (`jnp.where(step < 2, lr * 0.1, lr)`)."""
    if name == "select_n" and len(got) > 2:
        owners = {_own_leaf(x) for x in got[1:]}
        return owners.pop() if len(owners) == 1 else None
    if name not in _SCALINGS or not got:
        return None
    own = [i for i, x in enumerate(got) if not _fixed(x)]
    if own == [] and len(got) == 1:
        own = [0]
    if len(own) != 1 or (name == "div" and own[0] != 0):
        return None  # (`2 / m` is no multiple of `m`)
    return _own_leaf(got[own[0]])


_SCALINGS = frozenset({"mul", "div", "neg"})


def _picked(name: str, got: list[_Var]) -> bool:
    """Whether a multiple of an own leaf (`_scaled`) has a factor the data picks among
    constants, there or in the multiple it scales (`_Var.picked`): a select by a predicate
    computed from the data picks."""
    if name == "select_n":
        return bool(got[0].sources) or any(x.picked for x in got[1:])
    return any(x.picked or x.stepwise for x in got)


def _stepwise(name: str, got: list[_Var]) -> bool:
    """Whether an operation computed from some parameter gives one of a few constants that
    the data only picks between (`_Var.stepwise`): a select between such values (its
    predicate aside), or arithmetic of them (`jnp.where(finite, 2.0, 0.5) * 0.5`)."""
    if not any(x.sources for x in got):
        return False
    if name == "select_n":
        return all(_fixed(x) for x in got[1:])
    return name in _ARITHMETIC and all(_fixed(x) for x in got)


_ARITHMETIC = frozenset(
    {"mul", "div", "add", "sub", "neg", "convert_element_type", "broadcast_in_dim", "reshape"}
)


def _weighted(name: str, got: list[_Var]) -> frozenset[Weight]:
    """The weights an operation's output sums (`Flow.weighted`): a product or quotient of a
    parameter's own leaf, or a value computed from it alone (`T**2`, `1 - alpha`), and a
    value computed from others, not taking that leaf (`alpha * kd`; `a / (a + b)`
    normalises `a`); and those its operands sum, through sums, negations, sums over axes,
    casts, products with constants and selects."""
    if name in ("mul", "div") and len(got) == 2:
        a, b = got
        found = {
            Weight(p, other.sources, bare=_bare(name, own, other, p))
            for own, other in ((a, b), (b, a))
            if (p := _of_one(own)) is not None and not _fixed(other) and not _normalises(other, p)
        }
        found |= b.weighted if _fixed(a) else frozenset()
        found |= a.weighted if _fixed(b) else frozenset()
        return frozenset(found)
    if name in _SUMMING:
        return frozenset(w._replace(bare=False) for x in got for w in x.weighted)
    if name in _LINEAR:
        return frozenset().union(*(x.weighted for x in got))
    if name == "select_n":  # (its cases, not its predicate)
        return frozenset().union(*(x.weighted for x in got[1:]))
    return frozenset()


def _bare(name: str, own: _Var, other: _Var, p: str) -> bool:
    """`Weight.bare`: a product of `p`'s own leaf or a value of it alone and a value not
    computed from `p` (`jnp.exp(log_w) * part`), or either over the other (`loss / scale`,
    `part / (2 * sigma**2)`); not a Welford mean's `(n * mean + b * m) / (n + b)`, whose
    numerator is computed from the same parameter."""
    return name == "mul" or _own_leaf(own) == p or p not in other.sources


def _of_one(x: _Var) -> str | None:
    """The parameter `x` is an own leaf of, or computed from alone (and not a constant)."""
    if (own := _own_leaf(x)) is not None:
        return own
    return next(iter(x.sources)) if len(x.sources) == 1 and not x.stepwise else None


def _normalises(x: _Var, p: str) -> bool:
    """Whether `x` takes `p`'s own leaf other than as a weight (`a + b` over `a`): a leaf
    normalised (`a / (a + b)`), not weighed; `(scale * loss) / scale` is weighed."""
    if _own_leaf(x) == p:
        return True
    return p in x.direct and not any(w.param == p for w in x.weighted)


_SUMMING = frozenset({"add", "sub", "add_any"})
_LINEAR = frozenset(
    {"add", "sub", "add_any", "neg", "reduce_sum", "broadcast_in_dim", "convert_element_type",
     "copy", "copy_p", "reshape", "squeeze", "expand_dims", "stop_gradient"}
)  # fmt: skip


def _reduced(eqn: Any, ins: list[tuple[Any, _Var]]) -> tuple[frozenset[str], frozenset[str]]:
    """(smooth, spread) of an operation's outputs (`_Var`): a reduction of an operand
    (`_REDUCTIONS`, to fewer elements) drops what was spread over it (the loss of a batch
    normalised by `mu`), not what was stacked into it (`jnp.min(jnp.stack([best, loss]))`);
    an operation giving more elements than an operand has spreads that operand (`x - mu`,
    a broadcast), unless it places it among others (`_PLACES`: a concatenate)."""
    name, size_out = _jax.name(eqn), _size(_jax.out_aval(eqn))
    smooth: set[str] = set()
    spread: set[str] = set()
    for v, x in ins:
        size_in = _size(_jax.var_aval(v))
        if name in _REDUCTIONS and size_in > size_out:
            smooth |= x.smooth - x.spread
            spread |= x.spread if size_out > 1 else _NONE
        else:
            smooth |= x.smooth
            spreads = size_out > size_in and name not in _PLACES
            spread |= x.spread | (x.smooth if spreads else _NONE)
    return frozenset(smooth), frozenset(spread)


# Operations that reduce an operand with more elements than their output (`Flow.smooth`):
# a sum, a mean, a norm; `x @ w` of vectors, a convolution's window (`w @ h` of a matrix and
# a vector reduces `w`, not `h`). And those that place an operand among others, where a
# larger output does not spread it (`_reduced`).
_REDUCTIONS = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
        "reduce_xor", "argmax", "argmin", "reduce", "dot_general", "conv_general_dilated",
    }
)  # fmt: skip
_PLACES = frozenset(
    {"concatenate", "stack", "pad", "dynamic_update_slice", "scatter", "scatter-add", "scatter_add"}
)


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


# Operations that pass a value through (a cast, a copy, a reshape, a sharding constraint:
# `jax.lax.with_sharding_constraint`, `eqx.filter_shard`): what they make is still the
# parameter's own leaf for `flows`; a sharding constraint also takes what the operation under
# it takes (`_operation`).
_PASS_THROUGH = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "sharding_constraint",
    }
)
