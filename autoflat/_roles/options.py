"""The role options a user gives `autoflat.step`, and the roles themselves.

- `Role`: state, scanned (per-step), broadcast or static;
- `Options`: `state=`, `broadcast=`, `static_argnames=`, `per_step=`, a method's instance
  and the parameters a `functools.partial` binds, checked against the parameters and the
  returns by `check_options`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .._analysis.analysis import Analysis
from .._errors import (
    BAD_OPTION,
    BOUND_RETURNED,
    BOUND_STATE,
    BOUND_VARIADIC,
    ROLE_CONFLICT,
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
    # Parameters a `functools.partial` around the step binds: the same value every call.
    bound: frozenset[str] = frozenset()

    @property
    def explicit(self) -> frozenset[str]:
        """The parameters rule 1 decides whatever the source says: those named in
        `static_argnames=`, `broadcast=` or `per_step=`, and a method's instance."""
        named = self.static | self.broadcast | self.per_step
        return named if self.instance is None else named | {self.instance}


def check_options(analysis: Analysis, options: Options) -> None:
    """Raise an `OptionError` for option names that are not parameters or that give one
    parameter two roles, and for a parameter a `functools.partial` binds that would be state
    given back by a return (`state=`; a `SourceError` where a return names it): its new value
    could never reach a later step (`assign_roles` calls this first)."""
    _check_bound(analysis, options)
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


def check_bound_variadic(analysis: Analysis, options: Options, into: dict[str, str]) -> None:
    """With num_steps > 1, a `functools.partial` binding into `*args` or `**kwargs` (`into`:
    per parameter, what it binds there) unless an option names the parameter: it takes one
    role for the bound values and the call's, and a bound value is the same every call."""
    for p, what in into.items():
        if p not in options.explicit:
            kind = next(q.kind for q in analysis.params if q.name == p)
            star = "*" if kind == "var_positional" else "**"
            raise error(OptionError, BOUND_VARIADIC, analysis, param=p, star=star, what=what)


def _check_bound(analysis: Analysis, options: Options) -> None:
    """A bound parameter is never state a return gives back (it may be state written back
    into the bound object: rules 5 to 7)."""
    for p in sorted(options.bound & options.state):
        raise error(OptionError, BOUND_STATE, analysis, param=p)
    for r in analysis.returns:
        for name in r.names:
            if name in options.bound and name not in options.explicit:
                raise error(SourceError, BOUND_RETURNED, analysis, param=name)
