"""The role options a user gives `autoflat.step`, and the roles themselves.

- `Role`: state, scanned (per-step), broadcast or static;
- `Options`: `state=`, `broadcast=`, `static_argnames=`, `per_step=` and a method's instance,
  checked against the parameters by `check_options`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .._analysis.analysis import Analysis
from .._errors import BAD_OPTION, ROLE_CONFLICT, OptionError, error

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

    @property
    def explicit(self) -> frozenset[str]:
        """The parameters rule 1 decides whatever the source says: those named in
        `static_argnames=`, `broadcast=` or `per_step=`, and a method's instance."""
        named = self.static | self.broadcast | self.per_step
        return named if self.instance is None else named | {self.instance}


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
