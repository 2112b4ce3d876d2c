"""Stage 2: give every parameter a role, from the analysis, the options and what the first
call settled (`_infer`).

- *state*: carried from step to step, crossing the jit boundary as leaves of a cached
  structure. A parameter is state if every `return` returns it by name at the same position,
  if a return position matches it by abstract value (`RunTime.matched`), if the body assigns
  into it, if its run-time value is a mutable module object, or if the user names it in
  `state=`.
- *scanned*: per-step data with a leading axis of `num_steps` (or, with `num_steps=1`, the
  per-call input as it is).
- *broadcast*: the same value for every step of one call.
- *static*: a hashable Python value that selects a compiled version.

Returned values that are not state are per-step outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from .._analysis.analysis import Analysis, Return
from .._errors import (
    BAD_OPTION,
    RETURNS_DISAGREE,
    ROLE_CONFLICT,
    AutoflatError,
    OptionError,
    SourceError,
    error,
)

Role = Literal["state", "scanned", "broadcast", "static"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The role options a user gave `autoflat.step`."""

    state: frozenset[str] = frozenset()
    broadcast: frozenset[str] = frozenset()
    static: frozenset[str] = frozenset()
    per_step: frozenset[str] = frozenset()
    # `state={"p": 0}`: state parameters with the return position that gives them back.
    state_at: tuple[tuple[str, int], ...] = ()
    # A method's instance (`self`), broadcast without the user asking.
    instance: str | None = None


@dataclasses.dataclass(frozen=True)
class RunTime:
    """What the first call settled that the source could not (see `_infer`): a role and its
    evidence for parameters the source and options left open, and return positions matched to
    parameters by abstract value."""

    kinds: tuple[tuple[str, Role, str], ...] = ()
    matched: tuple[tuple[str, int, str], ...] = ()
    # A `return f(...)` whose value was a tuple of this many items with state among them
    # (`return update(params, opt_state, batch)`): its items are the return positions. For a
    # dict (`return {"params": ..., "loss": ...}`), its keys, in that order.
    unpacked: int = 0
    keys: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the user's return value is assembled from carried state and per-step outputs.

    `entries` has one item per returned element: `("state", i)` for the i-th state parameter,
    `("out", j)` for the j-th per-step output. `"unpacked"`: the step returns one expression
    whose value is a tuple or a dict (`RunTime.unpacked`), unpacked into the entries.
    """

    kind: Literal["none", "single", "tuple", "unpacked"]
    entries: tuple[tuple[Literal["state", "out"], int], ...]
    keys: tuple[Any, ...] = ()  # "unpacked" from a dict: its keys, one per entry

    @property
    def n_outputs(self) -> int:
        return sum(1 for k, _ in self.entries if k == "out")


@dataclasses.dataclass(frozen=True)
class Roles:
    """The role of every parameter (in signature order) and the return layout."""

    params: tuple[str, ...]
    roles: tuple[Role, ...]
    reasons: tuple[str, ...]
    layout: Layout

    def of(self, role: Role) -> tuple[str, ...]:
        return tuple(p for p, r in zip(self.params, self.roles, strict=True) if r == role)

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
        """State parameters that are not returned: the caller's objects are updated in place."""
        returned = set(self.returned_state)
        return tuple(p for p in self.state if p not in returned)


def check_options(analysis: Analysis, options: Options) -> None:
    """Raise an `OptionError` for option names that are not parameters or that give one
    parameter two roles (`assign_roles` calls this first)."""
    names = set(analysis.param_names)
    seen: dict[str, str] = {}
    for label, group in (
        ("state=", options.state),
        ("broadcast=", options.broadcast),
        ("static_argnames=", options.static),
        ("per_step=", options.per_step),
    ):
        for p in sorted(group):
            if p not in names:
                raise error(
                    OptionError,
                    BAD_OPTION,
                    analysis,
                    what=f"{label} names `{p}`, which is not a parameter",
                    params=", ".join(analysis.param_names) or "(none)",
                )
            if p in seen:
                raise error(
                    OptionError, ROLE_CONFLICT, analysis, param=p, first=seen[p], second=label
                )
            seen[p] = label


def returned_by_name(analysis: Analysis, options: Options) -> dict[str, int]:
    """Parameters that every `return` gives back by name, at the same position. One that some
    returns give back by name and others as another expression at that position (`return p,
    s, loss` in a branch, `return new_p, new_s, loss` at the end) is left to matching by
    value; one given back by name at two positions is a disagreement."""
    params = analysis.param_names
    explicit = options.broadcast | options.static | options.per_step | {options.instance}
    returns = analysis.returns
    first = returns[0] if returns else None
    returned_at: dict[str, int] = {}
    if first is None or first.kind == "none":
        return returned_at
    seen: dict[str, tuple[int, Return]] = {}
    at: dict[int, tuple[str, Return]] = {}
    for r in returns:
        for pos, name in enumerate(r.names):
            if name is None or name not in params or name in explicit:
                continue
            if name in seen and seen[name][0] != pos:
                raise _disagree(analysis, seen[name][1], r)
            if pos in at and at[pos][0] != name:  # `return p, ...` here, `return s, ...` there
                raise _disagree(analysis, at[pos][1], r)
            seen.setdefault(name, (pos, r))
            at.setdefault(pos, (name, r))
    for name, (pos, _) in seen.items():
        if all(r.names[pos] == name for r in returns):
            returned_at[name] = pos
    return dict(sorted(returned_at.items(), key=lambda item: item[1]))


def named_in_some(analysis: Analysis, options: Options) -> dict[str, int]:
    """Parameters some returns give back by name at a position where others return another
    expression (`returned_by_name` leaves them out): that position, their place."""
    returned = returned_by_name(analysis, options)
    explicit = options.broadcast | options.static | options.per_step | {options.instance}
    found: dict[str, int] = {}
    for r in analysis.returns:
        if r.kind == "none":
            continue
        for pos, name in enumerate(r.names):
            if name in analysis.param_names and name not in explicit and name not in returned:
                found.setdefault(name, pos)
    return found


def assign_roles(
    analysis: Analysis,
    options: Options,
    mutable_at_run_time: frozenset[str] = frozenset(),
    run_time: RunTime | None = None,
) -> Roles:
    """Combine source analysis, explicit options and run-time types into `Roles`.

    **Arguments:**

    - `analysis`: the step function's `Analysis`.
    - `options`: explicit role options.
    - `mutable_at_run_time`: parameters whose values in this call are mutable module objects.
    - `run_time`: what the first call settled (`_infer`); None at decoration, where every
      parameter the source leaves open is a per-step input.

    **Returns:**

    A `Roles` value.

    **Raises:**

    `OptionError` for options that do not fit the parameters (see `check_options`);
    `SourceError` when the returns disagree about which state they return where.
    """
    check_options(analysis, options)
    params = analysis.param_names
    returns = analysis.returns
    first = returns[0] if returns else None
    returned_at = returned_by_name(analysis, options)
    kinds: dict[str, tuple[Role, str]] = {}
    matched: dict[str, tuple[int, str]] = {}
    if run_time is not None:
        kinds = {p: (role, why) for p, role, why in run_time.kinds}
        matched = {p: (pos, why) for p, pos, why in run_time.matched}
    positions = {**{p: pos for p, (pos, _) in matched.items()}, **returned_at}

    assigned_line = dict(analysis.assigned_lines)
    roles: list[Role] = []
    reasons: list[str] = []
    for p in params:
        if p in options.static:
            roles.append("static")
            reasons.append("static_argnames=")
        elif p == options.instance and p not in matched:
            roles.append("broadcast")
            read = [f"{p}.{a}" for q, a in analysis.attribute_reads if q == p]
            reasons.append(
                "the method's instance"
                + (f"; a new value of {', '.join(read)} recompiles" if read else "")
            )
        elif p in options.broadcast:
            roles.append("broadcast")
            reasons.append("broadcast=")
        elif p in options.per_step:
            roles.append("scanned")
            reasons.append("per_step=")
        elif p in returned_at:
            roles.append("state")
            reasons.append("returned")
        elif p in matched:
            roles.append("state")
            reasons.append(matched[p][1])
        elif p in options.state:
            roles.append("state")
            reasons.append("state=")
        elif p in analysis.assigned:
            roles.append("state")
            reasons.append(f"assigned into at line {assigned_line[p]}")
        elif p in mutable_at_run_time:
            roles.append("state")
            reasons.append(kinds[p][1] if p in kinds else "mutable module at run time")
        elif p in kinds:
            roles.append(kinds[p][0])
            reasons.append(kinds[p][1])
        else:
            roles.append("scanned")
            reasons.append("per-step input")

    state = [p for p, r in zip(params, roles, strict=True) if r == "state"]
    entries: list[tuple[Literal["state", "out"], int]] = []
    out_index = 0
    kind: Literal["none", "single", "tuple", "unpacked"] = (
        first.kind if first is not None else "none"
    )
    arity = len(first.names) if first is not None and first.kind == "tuple" else 1
    if run_time is not None and run_time.unpacked:
        kind, arity = "unpacked", run_time.unpacked
    if first is not None:
        by_position = {pos: p for p, pos in positions.items()}
        for pos in range(arity):
            owner = by_position.get(pos)
            if owner is not None and owner in state:
                entries.append(("state", state.index(owner)))
            else:
                entries.append(("out", out_index))
                out_index += 1
    return Roles(
        params=params,
        roles=tuple(roles),
        reasons=tuple(reasons),
        layout=Layout(kind, tuple(entries), run_time.keys if run_time is not None else ()),
    )


def _disagree(analysis: Analysis, first: Return, other: Return) -> AutoflatError:
    return error(
        SourceError, RETURNS_DISAGREE, analysis, first=first.describe(), second=other.describe()
    )
