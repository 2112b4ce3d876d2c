"""The role rules: one ordered table, the table of docs/roles.md rule for rule.

Each rule is a function of a `Context` (the analysis, the options and, once known, what the
first call settled) and one parameter. It gives back a role with its evidence, or None to
pass to the next rule. `RULES` lists them in precedence order and `decide` gives a parameter
the decision of the first rule that applies, with that rule's name for `show()`.

The source decides rules 1, 2, 4, 5 and 10 when a step is decorated. The other rules read the
first call (`Call`) and pass without it, so before the first call rule 13 takes every
parameter the source leaves open as a per-step input (rule 10 those a `functools.partial`
binds). At the first call, `infer` applies the
table before matching by abstract value, with nothing matched yet, for the roles the abstract
evaluation takes, then once more with everything it found.

A new case is a new rule or a change to one. A rule's helpers live beside it; matching by
abstract value (`matching`), the abstract evaluation (`abstract`) and the readings autoflat
refuses (`hazards`) are their own modules: `infer` runs them once and a rule reads what they
found from the `Call`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis, Return
from .._errors import RETURNS_DISAGREE, AutoflatError, SourceError, error
from .._handles.writeback import is_mutable_module
from .._transport.structure import is_array
from .abstract import SCALARS
from .hazards import raw_key_at_two
from .options import Options, Role

_STATIC_SCALARS = (str, bytes, type(None))

Evidence = tuple[Role, str]  # a role and the evidence for it


@dataclasses.dataclass(frozen=True)
class Call:
    """What the first call with arguments of some types settled (see `infer`)."""

    values: Mapping[str, Any]  # each parameter's argument
    num_steps: int
    may_mutate: bool = False  # whether mutable module arguments may be written back
    defaults: frozenset[str] = frozenset()  # parameters the call left at their default
    # Rule 3: parameter -> (return position, evidence), matched by abstract value or by name
    # in some returns.
    matched: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    state_at: Mapping[str, int] = dataclasses.field(default_factory=dict)  # rule 4: `state={p: i}`
    # Rule 8: Python numbers a return position gives back changed (counters), and with
    # num_steps=1 those the step needs concrete (-> the error tracing them raised).
    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    concrete: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # A `return f(...)` whose value's items are the return positions: how many, and for a
    # dict its keys (`Layout`).
    unpacked: int = 0
    keys: tuple[Any, ...] = ()
    named: type | None = None  # a NamedTuple's class, whose items are the return positions
    # The whole `return a, b` is one parameter's new value (`Inference.whole_return`).
    whole: bool = False

    def position(self, pos: int) -> str:
        """`return position 1`, or for a returned dict's items `return key 'params'`."""
        return f"return key {self.keys[pos]!r}" if self.keys else f"return position {pos}"


@dataclasses.dataclass(frozen=True)
class Context:
    """What the rules read: the source, the options, and the first call once it is known."""

    analysis: Analysis
    options: Options
    returned_at: Mapping[str, int]  # rule 2's finding (`returned_by_name`)
    call: Call | None = None  # None when the step is decorated

    def given_back(self, p: str) -> bool:
        """Whether a return position gives `p` back (rules 3, 4 and 8 at the first call)."""
        call = self.call
        return call is not None and (p in call.matched or p in call.state_at or p in call.counters)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of the table: its name (in `show()` and docs/roles.md) and its function."""

    name: str
    decide: Callable[[Context, str], Evidence | None]


@dataclasses.dataclass(frozen=True)
class Decision:
    """A parameter's role, the evidence for it, and the name of the rule that decided it."""

    role: Role
    why: str
    rule: str


def decide(ctx: Context, p: str) -> Decision | None:
    """The decision of the first rule of `RULES` that applies to `p`, or None if none does
    (an argument with mixed leading axes, refused unless matched: `hazards`)."""
    for rule in RULES:
        found = rule.decide(ctx, p)
        if found is not None:
            why = found[1]
            if p in ctx.options.bound:  # `show()` lists what a functools.partial binds
                why = f"bound by functools.partial; {why}"
            return Decision(found[0], why, rule.name)
    return None


# --- rule 1 --------------------------------------------------------------------------------


def option_or_self(ctx: Context, p: str) -> Evidence | None:
    """Named in `static_argnames=`, `broadcast=` or `per_step=`; a method's instance, unless
    a return position gives it back (rules 3 and 4) or it is a Flax NNX module (rule 7)."""
    options = ctx.options
    if p in options.static:
        return "static", "static_argnames="
    if p == options.instance and not ctx.given_back(p) and mutable_module(ctx, p) is None:
        # (a Flax NNX module's own method changes its Variables in place: rule 7 writes them
        # back, as `nnx.jit` of the method does)
        return "broadcast", "the method's instance" + _what_selects(ctx, p)
    if p in options.broadcast:
        return "broadcast", "broadcast="
    if p in options.per_step:
        return "scanned", "per_step="
    return None


def _what_selects(ctx: Context, p: str) -> str:
    """What of a method's instance selects a compiled version, as the runtime keys it
    (`_runtime.instance.instance_attributes`): for a plain object, the attributes the body
    reads that the instance holds itself; class attributes and methods are read when traced
    and not watched. A pytree instance's arrays are inputs; its structure (static fields)
    selects the version. Nothing before the first call, which settles it."""
    read = list(dict.fromkeys(a for q, a in ctx.analysis.attribute_reads if q == p))
    obj = ctx.call.values.get(p, _UNKNOWN) if ctx.call is not None else _UNKNOWN
    if obj is _UNKNOWN:
        return ""  # settled at the first call, by the instance's type
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(obj)):
        return (
            "; a pytree: its arrays are inputs, its structure and static fields select the "
            "compiled version"
        )
    if not hasattr(obj, "__dict__"):
        return "; the instance itself selects the compiled version (no __dict__ to watch)"
    own = [a for a in read if a in vars(obj)]
    other = [a for a in read if a not in own]
    says = f"; a new value of {', '.join(f'{p}.{a}' for a in own)} recompiles" if own else ""
    if other:
        names = ", ".join(f"{p}.{a}" for a in other)
        says += f"; {names} (of the class: read when traced, not watched)"
    return says


_UNKNOWN = object()


# --- rule 2 --------------------------------------------------------------------------------


def returned(ctx: Context, p: str) -> Evidence | None:
    """Returned by name at the same position of every `return` (`returned_by_name`); at
    several positions (`return p, p`), at the first: the others are per-step outputs."""
    if p not in ctx.returned_at:
        return None
    pos = ctx.returned_at[p]
    also = sorted(
        {q for r in ctx.analysis.returns for q, n in enumerate(r.names) if n == p} - {pos}
    )
    if not also:
        return "state", "returned"
    listed = ", ".join(map(str, also))
    s, it = ("s", "return") if len(also) > 1 else ("", "returns")
    why = f"returned at return position {pos}; position{s} {listed} also {it} it"
    return "state", f"{why}: a per-step output{s}"


def returned_by_name(analysis: Analysis, options: Options) -> dict[str, int]:
    """Parameters that every `return` gives back by name at their state position
    (`named_positions`). One that some returns give back by name and others as another
    expression at that position (`return p, s, loss` in a branch, `return new_p, new_s, loss`
    at the end) is left to matching by value (`named_in_some`)."""
    returns = analysis.returns
    return {
        name: pos
        for name, pos in named_positions(analysis, options).items()
        if all(pos < len(r.names) and r.names[pos] == name for r in returns)
    }


def named_positions(analysis: Analysis, options: Options) -> dict[str, int]:
    """Each parameter some `return` names, with its state position: the first position any
    return names it at, in order of position. Its other positions are per-step outputs
    (`return p, p`, `return params, opt_state, params`: a trajectory logged), each named by
    it in every return that names it there or by no parameter. A `SourceError` where the
    returns disagree: two parameters named at one position (`return p, ...` here, `return s,
    ...` there), or one named in some return only away from its state position, at a
    position another return gives something else (`return p, loss` here, `return loss, p`
    there)."""
    params, explicit, returns = analysis.param_names, options.explicit, analysis.returns
    if not returns or returns[0].kind == "none":
        return {}
    at: dict[int, tuple[str, Return]] = {}  # the parameter a position names, and where first
    state: dict[str, int] = {}
    for r in returns:
        for pos, name in enumerate(r.names):
            if name is None or name not in params or name in explicit:
                continue
            if pos in at and at[pos][0] != name:  # `return p, ...` here, `return s, ...` there
                raise _disagree(analysis, at[pos][1], r)
            at.setdefault(pos, (name, r))
            state[name] = min(pos, state.get(name, pos))
    # `state={"p": 1}`: the user's position, unless another parameter is named there.
    chosen = dict(options.state_at)
    state.update({p: pos for p, pos in chosen.items() if p in state and at.get(pos, (p,))[0] == p})
    for name, pos in state.items():
        for r in returns:
            if pos < len(r.names) and r.names[pos] == name:
                continue
            # Away from its state position in this return: only where every return names it.
            for q in (q for q, n in enumerate(r.names) if n == name):
                other = next((o for o in returns if o.names[q] != name), None)
                if other is not None:
                    first, second = sorted((other, r), key=lambda o: o.line)
                    raise _disagree(analysis, first, second)
    return dict(sorted(state.items(), key=lambda item: item[1]))


def repeated_at(analysis: Analysis, options: Options) -> frozenset[int]:
    """Return positions naming a parameter away from its state position (`return p, p`):
    per-step outputs, never matched by value to another parameter."""
    state = named_positions(analysis, options)
    return frozenset(
        pos
        for r in analysis.returns
        for pos, name in enumerate(r.names)
        if name in state and pos != state[name]
    )


def _disagree(analysis: Analysis, first: Return, other: Return) -> AutoflatError:
    return error(
        SourceError, RETURNS_DISAGREE, analysis, first=first.describe(), second=other.describe()
    )


# --- rule 3 --------------------------------------------------------------------------------


def matched_by_value(ctx: Context, p: str) -> Evidence | None:
    """A return position whose abstract value matches `p` at the first call (`matching`), or
    where some returns give `p` back by name and others another expression
    (`named_in_some`, checked by value)."""
    call = ctx.call
    if call is None or p not in call.matched:
        return None
    pos, why = call.matched[p]
    if call.keys:  # a returned dict's positions are its keys
        why = re.sub(r"return position (\d+)\b", lambda m: call.position(int(m[1])), why)
    return "state", why


def named_in_some(analysis: Analysis, options: Options) -> dict[str, int]:
    """Parameters some returns give back by name at their state position where others return
    another expression (`returned_by_name` leaves them out): that position, their place."""
    returned = returned_by_name(analysis, options)
    return {
        name: pos
        for name, pos in named_positions(analysis, options).items()
        if name not in returned
    }


# --- rule 4 --------------------------------------------------------------------------------


def state_option(ctx: Context, p: str) -> Evidence | None:
    """Named in `state=` (at the first call, rule 3 must have matched it, or the body assigns
    into it or changes it in place: `infer` refuses it otherwise)."""
    call = ctx.call
    if call is not None and p in call.state_at:
        return "state", f"state= at {call.position(call.state_at[p])}"
    return ("state", "state=") if p in ctx.options.state else None


# --- rule 5 --------------------------------------------------------------------------------


def assigned_into(ctx: Context, p: str) -> Evidence | None:
    """Assigned into in the body (`d["w"] = ...`, `m.count = ...`, `setattr(m, ...)`)."""
    if p not in ctx.analysis.assigned:
        return None
    return "state", f"assigned into at line {dict(ctx.analysis.assigned_lines)[p]}"


# --- rule 6 --------------------------------------------------------------------------------


def changed_in_place(ctx: Context, p: str) -> Evidence | None:
    """A dict or list the body changes in place (`d.update(...)`, `xs.append(x)`): written
    back into the caller's object, as `d[k] = ...` is."""
    call = ctx.call
    if call is None or not isinstance(call.values[p], (dict, list)):
        return None
    found = {q: (spelling, line) for q, spelling, line in ctx.analysis.in_place}.get(p)
    if found is None:
        return None
    spelling, line = found
    return "state", (
        f"a {call.values[p].__class__.__name__} changed in place (`{spelling}` at line "
        f"{line}): its new value is written into the caller's object after the call"
    )


def taken_from(ctx: Context, p: str, found: Evidence) -> Evidence:
    """The decision of a later rule (9 to 13) for a dict or list the body only takes from
    (`labels = batch.pop("labels")`, `del batch["mask"]`), which is not state: the step
    changes its own copy, as under `jax.jit`, and the evidence says so."""
    call = ctx.call
    removed = {q: (spelling, line) for q, spelling, line in ctx.analysis.removed}
    if call is None or p not in removed or not isinstance(call.values[p], (dict, list)):
        return found
    spelling, line = removed[p]
    return found[0], (
        f"{found[1]}; `{spelling}` at line {line} changes the step's own copy, as under "
        "jax.jit, not your object"
    )


# --- rule 7 --------------------------------------------------------------------------------


def mutable_module(ctx: Context, p: str) -> Evidence | None:
    """A Flax NNX module, optimizer or metric (mutated in place): its new Variable values are
    written back into the caller's object."""
    call = ctx.call
    if call is None or not (call.may_mutate and is_mutable_module(call.values[p])):
        return None
    return "state", (
        f"{describe(call.values[p])} mutated in place: its new Variable values are written "
        "into the caller's object after the call"
    )


def describe(value: Any) -> str:
    """`a Model`, `a flax.Optimizer`, `a equinox.MLP`: the class, with its library's name."""
    t = value.__class__  # a handle's: its object's class
    root = t.__module__.split(".")[0]
    known = ("flax", "equinox", "optax", "jax", "haiku", "numpy")
    return f"a {root}.{t.__qualname__}" if root in known else f"a {t.__qualname__}"


# --- rule 8 --------------------------------------------------------------------------------


def python_scalar(ctx: Context, p: str) -> Evidence | None:
    """A string, bytes or None is static, as in `eqx.filter_jit`; with num_steps > 1 any
    Python number too, unless a return position gives it back changed at its place
    (`scalars.counters`), or as a scalar array made by adding to it (`total + loss`,
    `scalars.accumulated`): then state, carried as an array; with num_steps=1 a
    Python number the step needs concrete (`scalars.settle_scalars`)."""
    call = ctx.call
    if call is None:
        return None
    value = call.values[p]
    kind = type(value).__name__
    if p in call.counters:
        return "state", (
            f"a Python {kind} that {call.position(call.counters[p])} gives back changed: "
            "carried as an array"
        )
    if p in call.concrete:
        return "static", (
            f"a Python {kind} the step needs as a concrete value (traced, it raised "
            f"{call.concrete[p]}): static, as with static_argnames"
        )
    if isinstance(value, _STATIC_SCALARS) or (call.num_steps > 1 and isinstance(value, SCALARS)):
        return "static", f"a Python {kind}, static as in eqx.filter_jit"
    return None


# --- rule 9 --------------------------------------------------------------------------------


def untraceable(ctx: Context, p: str) -> Evidence | None:
    """Holds values JAX cannot trace (an Equinox module's functions, an optax
    `GradientTransformation`): broadcast. Not a plain tuple, list or dict with num_steps > 1
    where an item, an array or a plain container of them, has a leading axis of num_steps
    on all its arrays (`*batch` of `(xs, "sum")`): mixed, refused
    (`hazards.leading_axis_error`)."""
    call = ctx.call
    if call is None:
        return None
    value = call.values[p]
    leaves = jax.tree_util.tree_leaves(value)
    if all(is_array(x) or isinstance(x, SCALARS) for x in leaves):
        return None
    if call.num_steps > 1 and type(value) in (tuple, list, dict):
        items = value.values() if type(value) is dict else value
        for item in items:
            if not (is_array(item) or type(item) in (tuple, list, dict)):
                continue  # (a module's arrays: a layer of 4 units beside its functions)
            arrays = [x for x in jax.tree_util.tree_leaves(item) if is_array(x)]
            if arrays and len(_with_axis(arrays, call.num_steps)) == len(arrays):
                return None
    return taken_from(ctx, p, ("broadcast", f"{describe(value)}, holds values JAX cannot trace"))


# --- rule 10 -------------------------------------------------------------------------------


def bound_argument(ctx: Context, p: str) -> Evidence | None:
    """Bound by a `functools.partial` around the step: the same value on every call, as
    `jax.jit` of the partial holds it. Arrays are broadcast (never sliced per step), a Python
    number is a constant (static). Rules 2 to 4 never make it state (`check_options`)."""
    if p not in ctx.options.bound:
        return None
    call = ctx.call
    if call is not None and isinstance(call.values[p], SCALARS):
        kind = type(call.values[p]).__name__
        return "static", f"a Python {kind}, a constant as under jax.jit of the partial"
    return taken_from(ctx, p, ("broadcast", "the same value every call"))


# --- rule 11 -------------------------------------------------------------------------------


def leading_axis(ctx: Context, p: str) -> Evidence | None:
    """With num_steps > 1, every array leaf has a leading axis of num_steps: per-step. A
    default value the call did not pass (`class_weights=W`) is the same every step, even if
    its first axis happens to be num_steps; a raw `uint32[2]` PRNG key at num_steps=2 passes,
    to be refused (`hazards.leading_axis_error`)."""
    call = ctx.call
    if call is None or call.num_steps == 1:
        return None
    value, k = call.values[p], call.num_steps
    leaves = jax.tree_util.tree_leaves(value)
    with_axis = _with_axis(leaves, k)
    raw_key = raw_key_at_two(value, k)
    if p in call.defaults and (with_axis or raw_key):
        return taken_from(ctx, p, ("broadcast", "its default value, the same every step"))
    if with_axis and len(with_axis) == len(leaves) and not raw_key:
        found: Evidence = ("scanned", f"per-step: leading axis {k} = num_steps at the first call")
        return taken_from(ctx, p, found)
    return None


def _with_axis(leaves: list[Any], num_steps: int) -> list[Any]:
    """The array leaves with a leading axis of `num_steps`."""
    return [x for x in leaves if is_array(x) and np.ndim(x) >= 1 and np.shape(x)[0] == num_steps]


def defaulted(fn: Callable[..., Any], values: Mapping[str, Any]) -> frozenset[str]:
    """The parameters whose value is their default (the call did not pass them)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(
        p.name
        for p in parameters
        if p.default is not inspect.Parameter.empty
        and p.name in values
        and values[p.name] is p.default
        and jax.tree_util.tree_leaves(p.default)
    )


# --- rule 12 -------------------------------------------------------------------------------


def no_leading_axis(ctx: Context, p: str) -> Evidence | None:
    """With num_steps > 1, no array leaf has a leading axis of num_steps: broadcast. A value
    with no array at all (`()`, an empty `*args`) is broadcast too, for want of evidence: a
    later call whose value there holds arrays with that leading axis is refused
    (`_runtime.call`), not silently read as broadcast."""
    call = ctx.call
    if call is None or call.num_steps == 1:
        return None
    k = call.num_steps
    leaves = jax.tree_util.tree_leaves(call.values[p])
    if _with_axis(leaves, k):
        return None
    if not any(map(is_array, leaves)):
        return taken_from(ctx, p, ("broadcast", HELD_NO_ARRAYS))
    return taken_from(ctx, p, ("broadcast", f"no leading axis of num_steps={k} at the first call"))


# The evidence of a broadcast argument that held no array at the first call.
HELD_NO_ARRAYS = "no arrays at the first call"


# --- rule 13 -------------------------------------------------------------------------------


def as_passed(ctx: Context, p: str) -> Evidence | None:
    """With num_steps=1, anything else is passed as it is, as `jax.jit` passes it; before the
    first call, anything the source leaves open."""
    call = ctx.call
    if call is None:
        return "scanned", "per-step input"
    if call.num_steps == 1:
        return taken_from(ctx, p, ("scanned", "per-step input"))
    return None


# The table, in precedence order: docs/roles.md lists the same rules in the same order.
RULES: tuple[Rule, ...] = (
    Rule("option-or-self", option_or_self),
    Rule("returned-by-name", returned),
    Rule("matched-by-value", matched_by_value),
    Rule("state-option", state_option),
    Rule("assigned-into", assigned_into),
    Rule("changed-in-place", changed_in_place),
    Rule("mutable-module", mutable_module),
    Rule("python-scalar", python_scalar),
    Rule("untraceable", untraceable),
    Rule("bound-argument", bound_argument),
    Rule("leading-axis", leading_axis),
    Rule("no-leading-axis", no_leading_axis),
    Rule("as-passed", as_passed),
)
