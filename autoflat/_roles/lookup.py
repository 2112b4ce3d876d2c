"""What a name written in the step's source stands for at the first call.

`Return.updates` records the optimizer whose `update` gave a returned name as written (`tx`,
`state.tx`, `call:optax.adam` for `optax.adam(...).update`, `state:opt_state` for the state
passed to it). `look_up` finds the object among the call's arguments, the step's closure and
its globals, and `is_optax` says whether it is optax's: an optax optimizer's updates are
never a parameter's new value (`infer.Inference._settle`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._transport.structure import attribute


def look_up(fn: Callable[..., Any], values: Mapping[str, Any], written: str) -> Any:
    """The object `written` names at the first call (`values`: the call's arguments by
    parameter), or None; for `state:...`, the first optax state object the named value
    holds."""
    if written.startswith("state:"):
        state = look_up(fn, values, written.removeprefix("state:"))
        found = jax.tree_util.tree_leaves(state, is_leaf=is_optax)
        return next((s for s in found if is_optax(s)), None)
    dotted = written.removeprefix("call:").split(".")
    code = getattr(fn, "__code__", None)
    scope = dict(zip(code.co_freevars, fn.__closure__ or (), strict=False)) if code else {}  # type: ignore[attr-defined]
    if dotted[0] in values:
        obj = values[dotted[0]]
    elif dotted[0] in scope:
        obj = _cell(scope[dotted[0]])
    else:
        obj = getattr(fn, "__globals__", {}).get(dotted[0])
    for name in dotted[1:]:
        obj = attribute(obj, name)
    return obj


def is_optax(obj: Any) -> bool:
    """Whether `obj` is optax's: an optimizer (`GradientTransformation`, `MultiSteps`), an
    optimizer state, or a function of optax (`optax.adam`, whose call gives an optimizer)."""
    if obj is None:
        return False
    module = obj.__module__ if callable(obj) and hasattr(obj, "__name__") else None
    module = module or type(obj).__module__
    return isinstance(module, str) and module.split(".")[0] == "optax"


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (not yet bound)
        return None
