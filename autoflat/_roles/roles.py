"""Every parameter's role, from the rule table (`rules`), and the return layout.

- *state*: carried from step to step, crossing the jit boundary as leaves of a cached
  structure;
- *scanned*: per-step data with a leading axis of `num_steps` (or, with `num_steps=1`, the
  per-call input as it is);
- *broadcast*: the same value for every step of one call;
- *static*: a hashable Python value that selects a compiled version.

Returned values that are not state are per-step outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from .._analysis.analysis import Analysis
from .._analysis.returns import nested, unnest
from .._handles.lazy import LazyHandle
from .._handles.writeback import is_mutable_module
from .options import Options as Options
from .options import Role as Role
from .options import check_options as check_options
from .rules import Call, Context, decide, describe, returned_by_name


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the user's return value is assembled from carried state and per-step outputs.

    `entries` has one item per returned element: `("state", i)` for the i-th state parameter,
    `("out", j)` for the j-th per-step output. `"unpacked"`: the step returns one expression
    whose value is a tuple or a dict (`Call.unpacked`), unpacked into the entries.
    """

    kind: Literal["none", "single", "tuple", "unpacked"]
    entries: tuple[tuple[Literal["state", "out"], int], ...]
    keys: tuple[Any, ...] = ()  # "unpacked" from a dict: its keys, one per entry
    nest: tuple[Any, ...] | None = None  # "tuple": the tuples looked into (`Return.nest`)
    # "single" from a `return a, b` whose whole tuple is one state parameter's new value
    whole: bool = False
    named: type | None = None  # "unpacked" from a NamedTuple: its class

    def build(self, items: list[Any]) -> Any:
        """The user's return value from its positions' `items`."""
        if self.kind == "none":
            return None
        if self.keys:
            return dict(zip(self.keys, items, strict=True))
        if self.named is not None:
            return self.named(*items)
        return items[0] if self.kind == "single" else nested(self.nest, items)

    def positions(self, value: Any) -> list[Any]:
        """The items at the return positions of a value `build` made (a step that returns
        something)."""
        if self.keys:
            return [value[k] for k in self.keys]
        return [value] if self.kind == "single" else unnest(self.nest, value) or []

    @property
    def n_outputs(self) -> int:
        return sum(1 for k, _ in self.entries if k == "out")


@dataclasses.dataclass(frozen=True)
class Roles:
    """The role of every parameter (in signature order), the evidence for it and the name of
    the rule that decided it, and the return layout."""

    params: tuple[str, ...]
    roles: tuple[Role, ...]
    reasons: tuple[str, ...]
    rules: tuple[str, ...]
    layout: Layout
    # Broadcast arguments read so by their shapes that a per-step output could be the new
    # value of (a weakly typed `total` beside `loss + total`), with that return position:
    # named if a later call passes the stacked outputs back there (`PER_STEP_AFTER_BROADCAST`).
    echoes: tuple[tuple[str, int], ...] = ()
    # Flax NNX objects returned by name that the caller's own object stands for
    # (`given_back`): written back, and returned as the caller's object.
    given_back: tuple[str, ...] = ()

    def of(self, role: Role) -> tuple[str, ...]:
        return tuple(p for p, r in zip(self.params, self.roles, strict=True) if r == role)

    @property
    def evidence(self) -> tuple[str, ...]:
        """Per parameter, its role with the evidence and the deciding rule, as `show()`'s
        header prints it: `state (returned) [rule: returned-by-name]`."""
        return tuple(
            f"{role} ({why}) [rule: {rule}]"
            for role, why, rule in zip(self.roles, self.reasons, self.rules, strict=True)
        )

    @functools.cached_property
    def state(self) -> tuple[str, ...]:
        # Cached: read on every call of a step. Equality and hashing use the fields only.
        return self.of("state")

    @property
    def returned_state(self) -> tuple[str, ...]:
        state = self.state
        return tuple(state[i] for k, i in self.layout.entries if k == "state")

    @property
    def written_back(self) -> tuple[str, ...]:
        """State parameters whose new value is written into the caller's object: those not
        returned, and those given back as the caller's object (`given_back`)."""
        returned = set(self.returned_state) - set(self.given_back)
        return tuple(p for p in self.state if p not in returned)


def assign_roles(analysis: Analysis, options: Options, call: Call | None = None) -> Roles:
    """Every parameter's role: the first rule of the table (`rules.RULES`) that decides it.

    **Arguments:**

    - `analysis`: the step function's `Analysis`.
    - `options`: explicit role options.
    - `call`: what the first call settled (`infer`); None at decoration, where every
      parameter the source leaves open is a per-step input.

    **Returns:**

    A `Roles` value.

    **Raises:**

    `OptionError` for options that do not fit the parameters (see `check_options`);
    `SourceError` when the returns disagree about which state they return where.
    """
    check_options(analysis, options)
    ctx = Context(analysis, options, returned_by_name(analysis, options), call)
    decisions = []
    for p in analysis.param_names:
        decision = decide(ctx, p)
        if decision is None:  # `infer` refuses such an argument before this
            raise AssertionError(f"no role rule decides `{p}`")
        decisions.append(decision)
    roles = tuple(d.role for d in decisions)
    layout = _layout(analysis, ctx, roles)
    given_back = _given_back(analysis, ctx, roles, layout)
    reasons = tuple(
        f"{d.why}; {describe(ctx.call.values[p])} given back as itself: its new Variable "
        "values are written into the caller's object, which the call returns"
        if ctx.call is not None and p in given_back
        else d.why
        for p, d in zip(analysis.param_names, decisions, strict=True)
    )
    return Roles(
        params=analysis.param_names,
        roles=roles,
        reasons=reasons,
        rules=tuple(d.rule for d in decisions),
        layout=layout,
        given_back=given_back,
    )


def _given_back(
    analysis: Analysis, ctx: Context, roles: tuple[Role, ...], layout: Layout
) -> tuple[str, ...]:
    """The state that the caller's own object stands for where it is returned: a Flax NNX
    object (module, optimizer, metric) passed as itself, returned by name at its position by
    every `return` and never bound again in the body. The returned object is the one passed
    in, changed in place, so its new Variable values are written into the caller's object
    and the call returns that object, as `nnx.jit` does (`return model, loss`): a caller who
    keeps using `model` and ignores what comes back sees the step's changes."""
    call = ctx.call
    if call is None or not call.may_mutate:
        return ()
    state = [p for p, r in zip(analysis.param_names, roles, strict=True) if r == "state"]
    at = {state[i]: pos for pos, (kind, i) in enumerate(layout.entries) if kind == "state"}
    named = {
        p: pos
        for p, pos in at.items()
        if layout.kind == "tuple" or (layout.kind == "single" and not layout.whole)
        if all(pos < len(r.names) and r.names[pos] == p for r in analysis.returns)
    }
    return tuple(
        p
        for p in state
        if p in named
        and p not in analysis.rebound
        and type(call.values[p]) is not LazyHandle
        and is_mutable_module(call.values[p])
    )


def _layout(analysis: Analysis, ctx: Context, roles: tuple[Role, ...]) -> Layout:
    """Each return position: a state parameter given back there, else a per-step output."""
    call = ctx.call
    positions = dict(ctx.returned_at)
    if call is not None:
        # In the order a later parameter at the same position wins, as `infer` found them.
        positions = {
            **call.state_at,
            **{p: pos for p, (pos, _) in call.matched.items()},
            **call.counters,
            **ctx.returned_at,
        }
    state = [p for p, r in zip(analysis.param_names, roles, strict=True) if r == "state"]
    first = analysis.returns[0] if analysis.returns else None
    kind: Literal["none", "single", "tuple", "unpacked"] = (
        first.kind if first is not None else "none"
    )
    arity = len(first.names) if first is not None and first.kind == "tuple" else 1
    if call is not None and call.unpacked:
        kind, arity = "unpacked", call.unpacked
    whole = call is not None and call.whole
    if whole:
        kind, arity = "single", 1
    entries: list[tuple[Literal["state", "out"], int]] = []
    if first is not None:
        by_position = {pos: p for p, pos in positions.items()}
        for pos in range(arity):
            owner = by_position.get(pos)
            if owner is not None and owner in state:
                entries.append(("state", state.index(owner)))
            else:
                entries.append(("out", sum(1 for k, _ in entries if k == "out")))
    nest = first.nest if first is not None and kind == "tuple" else None
    named = call.named if call is not None and kind == "unpacked" else None
    return Layout(kind, tuple(entries), call.keys if call is not None else (), nest, whole, named)
