"""First-call role inference: what the source leaves open, settled by the first call's values.

The source says which parameters are state when it returns them by name or assigns into them.
At a step's first call (and again for arguments of other types) `infer` finds what the rules
of the table (`rules`) read from the first call, and applies the table:

- **Per-step, broadcast or static, by run-time type and shape** (rules 6 to 13). An argument
  the source and options leave open is, with `num_steps=k > 1`: per-step if every array leaf
  has a leading axis of k; broadcast if none has (a reused key, a full batch, a teacher's
  weights) or if it holds values JAX cannot trace (an Equinox module's functions, an optax
  `GradientTransformation`); static if it is a hashable Python scalar or string (as in
  `eqx.filter_jit`). With `num_steps=1` arrays and Python numbers are passed as they are (as
  `jax.jit` passes them); strings are static and objects JAX cannot trace are broadcast.
- **State by abstract value** (rule 3). One step is evaluated abstractly (`abstract`: no
  compile) and each return position that does not return a parameter by name is matched to
  the parameter whose abstract value (tree structure, shapes, dtypes) it equals
  (`matching`); one that names a parameter away from its state position (`return p, p`) is
  a per-step output, and of positions giving back the very same value (`{"params": p,
  "log": p}`) a parameter takes the first. A container or module matches at any position,
  a bare array only at its own place among the parameters that can come back through a
  return (so a loss is never taken for a scalar input; a PRNG key also where nothing else
  fits). One candidate: state.
  Several alike: settled by the step's data flow (`flows`), then by names, else an error
  listing them with the `state=` that settles it. A parameter named in `state=` that no
  position matches is an error: never an old value carried unchanged. A single `return
  f(...)` giving a tuple or dict has its items as the positions where data flow says state
  is among them.
- **Python numbers at `num_steps > 1`** are static, unless given back changed at their place
  (a counter `step + 1`) or summed into an open position (`total + loss`): then state,
  carried as an array (rule 8).
- **Python numbers at `num_steps=1`** are traced, as `jax.jit` traces them; one the step needs
  concrete (a layer size) fails the abstract evaluation and is made static instead
  (`scalars`, rule 8).
- **Python scalars in state that a step changes** (`TrainState.step`, counted up from a
  Python int) become arrays before the first call (`Inferred.to_array`, `scalars`), so the
  step compiles once, as under `jax.jit`; scalars a step gives back unchanged stay static.

The readings this inference will not choose between (mixed or short leading axes, per-step or
state?, returned state a `lax.scan` carry would get wrong) are errors raised by `hazards` and
`state_hazards`: the ones the arguments show before any evaluation here, the rest by `checks`
once state is matched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from .._analysis.analysis import Analysis, Return
from .._errors import (
    NNX_NOT_PYTREE,
    STATE_POSITION,
    UNHASHABLE_STATIC,
    AutoflatError,
    CallError,
    OptionError,
    StateError,
    error,
)
from .._handles.nnx import opaque_module
from .._handles.writeback import is_mutable_module
from .._transport.structure import is_array
from . import matching as _matching
from . import names as _names
from .abstract import SCALARS, eval_one_step, narrowed, positions_of, same_value
from .checks import check_matches, check_state_positions
from .flow import Flow, flows, flows_traced
from .hazards import (
    check_returned_as_it_came_per_step,
    check_sliced_fails,
    check_written_per_step,
    gives_back_whole,
    leading_axis_error,
    note_per_step_by_shape,
    raise_leading_axis_errors,
    refuse_nested_modules,
)
from .lookup import is_optax, look_up
from .nesting import looked_into, whole_carry
from .options import Options, Role
from .roles import Roles, assign_roles
from .rules import (
    Call,
    Context,
    changed_in_place,
    decide,
    defaulted,
    mutable_module,
    named_in_some,
    repeated_at,
    returned_by_name,
)
from .scalars import accumulated, counters, scalars_to_array, settle_scalars
from .state_hazards import has_named_parts


@dataclasses.dataclass(frozen=True)
class Inferred:
    """The roles of one kind of call, and the Python scalar leaves of each state argument that
    become arrays (by leaf index, per state position)."""

    roles: Roles
    to_array: tuple[tuple[int, ...], ...]


def arg_kinds(args: tuple[Any, ...], handle_type: type) -> tuple[Any, ...]:
    """What selects the inferred roles of a call: each argument's type (a handle's object's,
    but for a Flax NNX object's handle, which is not the caller's own object to give back:
    `Roles.given_back`)."""
    return tuple(
        type(a)
        if type(a) is not handle_type
        else (handle_type, a.__class__)
        if is_mutable_module(a)
        else a.__class__
        for a in args
    )


def infer(
    analysis: Analysis,
    options: Options,
    num_steps: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    may_mutate: bool,
) -> Inferred:
    """The roles of a call with these arguments (see the module doc), in named steps."""
    analysis = looked_into(analysis, dict(zip(analysis.param_names, args, strict=True)), num_steps)
    run = Inference(analysis, options, num_steps, fn, args, may_mutate)
    run.refuse_arguments()
    run.roles_before_matching()
    run.state_positions()
    run.match_state()
    run.whole_return()
    check_state_positions(run)
    run.match_promoted()
    check_matches(run)
    return run.result()


class Inference:
    """One first call's inference: what each step finds, for the steps after it."""

    def __init__(
        self,
        analysis: Analysis,
        options: Options,
        num_steps: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        may_mutate: bool,
    ) -> None:
        self.analysis, self.options, self.num_steps, self.fn = analysis, options, num_steps, fn
        self.params = params = analysis.param_names
        self.returned_at = returned_by_name(analysis, options)
        self.values = values = dict(zip(params, args, strict=True))
        self.call = Call(values, num_steps, may_mutate)
        ctx = Context(analysis, options, self.returned_at, self.call)
        self.by_source = set(self.returned_at) | set(analysis.assigned)
        # Dicts and lists changed in place, mutable modules (rules 6 and 7): state written back
        # into the caller's objects.
        self.mutable = frozenset(
            p
            for p in params
            if p not in options.explicit | self.by_source
            and (changed_in_place(ctx, p) or mutable_module(ctx, p))
        )
        # What rules 1, 2 and 4 to 7 leave open: for the value rules, or matching (rule 3).
        self.open = [
            p
            for p in params
            if p not in options.explicit | self.by_source | self.mutable and p not in options.state
        ]
        self.kinds: dict[str, Role] = {}  # open parameters' roles before matching
        self.by_shape: list[str] = []  # of them, those per-step by their leading axis alone
        # Errors about an argument's leading axes wait until state is matched by value: a state
        # argument returned under another name may have leaves of any leading axis.
        self.deferred: dict[str, Exception] = {}
        self.for_eval: dict[str, Role] = {}  # each parameter's role for the abstract evaluation
        self.out: Any = None  # one step's abstract output, once evaluated
        self.first = analysis.returns[0] if analysis.returns else None
        self.unpacked = 0
        self.whole = False  # the whole return is one parameter's new value (`whole_return`)
        self.keys: tuple[Any, ...] = ()  # a returned dict's, when its items are the positions
        self.named: type | None = None  # a returned NamedTuple's class, likewise
        self.state_at = dict(options.state_at)
        self.matched: dict[str, tuple[int, str]] = {}  # rule 3
        self.by_value: dict[str, int] = {}  # of those, matched by abstract value alone
        self.counters: dict[str, int] = {}  # rule 8
        self.concrete: dict[str, str] = {}  # rule 8
        # State declared, not returned by name nor written into: matched by value, or refused.
        self.declared = {p for p in options.state if p not in self.by_source | self.mutable}
        self.open_positions: list[int] = []
        self.outputs: list[Any] | None = None
        self.pending: list[str] = []
        self._added: list[Flow] | None = None  # additions
        # `flow_of`'s results (results only: a closure here would make a cycle holding `values`)
        self._flows: dict[Return, list[Flow]] = {}

    def given_back(self, counters: bool = True) -> dict[str, int]:
        """Every parameter a return position gives back, with its position (with or without
        the Python counters)."""
        return {
            **self.state_at,
            **{p: pos for p, (pos, _) in self.matched.items()},
            **(self.counters if counters else {}),
        }

    def evaluate(self) -> Any:
        """One step's abstract output (`abstract.eval_one_step`), evaluated once."""
        if self.out is None:
            try:
                self.out = eval_one_step(
                    self.fn, self.params, self.values, self.for_eval, self.num_steps
                )
            except Exception as e:
                # The step failed on an argument taken as broadcast for the evaluation: the
                # leading-axis error says what to declare.
                raise_leading_axis_errors(
                    self.analysis, self.kinds, self.deferred, self.values, self.num_steps,
                    self.options, e,
                )  # fmt: skip
                self._probe_sliced(e)
                note_per_step_by_shape(e, self.by_shape, self.num_steps)
                raise
        return self.out

    def _probe_sliced(self, e: Exception) -> None:
        """The step failed (`e`) with arguments taken per-step by their leading axis alone:
        where one of them, carried whole, makes it trace and is given back whole at an open
        return position (per-environment keys split under `new_keys`), the question of
        `hazards.check_sliced_fails` rather than JAX's error about a slice."""
        if self.num_steps == 1 or self.first is None or not self.open_positions:
            return
        traces = [
            p
            for p in self.params
            if self.kinds.get(p) == "scanned"
            and p not in self.options.per_step
            and gives_back_whole(
                p,
                self.open_positions,
                self.first,
                self.fn,
                self.params,
                self.values,
                self.for_eval,
                self.num_steps,
            )
        ]
        check_sliced_fails(self.analysis, traces, e, self.num_steps)

    def refuse_arguments(self) -> None:
        """Refuse what no rule can take: a written argument that looks per-step, an object
        Flax NNX cannot split, an unhashable static argument."""
        analysis, options, values = self.analysis, self.options, self.values
        if self.num_steps > 1:
            check_written_per_step(
                analysis, options, self.returned_at, self.mutable, values, self.num_steps
            )
            check_returned_as_it_came_per_step(
                analysis, options, self.returned_at, values, self.num_steps
            )
        for p in self.params:
            opaque = None if p in options.static else opaque_module(values[p])
            if opaque is not None:
                path, obj = opaque
                raise error(
                    StateError,
                    NNX_NOT_PYTREE,
                    analysis,
                    param=p,
                    holds=f"holds at `{p}{path}`" if path else "is",
                    cls=obj.__class__.__qualname__,
                )
        for p in options.static:
            try:
                hash(values[p])
            except TypeError:
                raise error(
                    CallError, UNHASHABLE_STATIC, analysis, param=p, type=type(values[p]).__name__
                ) from None

    def roles_before_matching(self) -> None:
        """The table applied to the open parameters with nothing matched yet: the roles the
        abstract evaluation takes (candidates for state count as broadcast); with
        num_steps=1, the Python numbers the step needs concrete (rule 8)."""
        if self.num_steps > 1:
            self.call = dataclasses.replace(self.call, defaults=defaulted(self.fn, self.values))
        ctx = Context(self.analysis, self.options, self.returned_at, self.call)
        for p in self.open:
            found = decide(ctx, p)
            if found is None:  # no rule settles its leading axes
                self.deferred[p] = leading_axis_error(
                    self.analysis, p, self.values[p], self.num_steps
                )
                self.kinds[p] = "broadcast"  # a state candidate for now
            else:
                self.kinds[p] = found.role
                if found.rule == "leading-axis":
                    self.by_shape.append(p)
        for p in self.params:
            if p in self.mutable:
                self.kinds[p] = "state"
        for_eval = self.for_eval
        for_eval.update({p: self.kinds.get(p, "state") for p in self.params})
        for_eval.update(dict.fromkeys(self.options.static, "static"))
        for_eval.update(dict.fromkeys(self.options.per_step, "scanned"))
        if self.num_steps == 1:
            traced = [
                p
                for p in self.open
                if self.kinds[p] == "scanned" and isinstance(self.values[p], SCALARS)
            ]
            if traced:
                self.out, self.concrete = settle_scalars(
                    self.fn, self.params, self.values, for_eval, traced
                )
                self.kinds.update(dict.fromkeys(self.concrete, "static"))

    def state_positions(self) -> None:
        """The return positions `state={"p": 0}` names (rule 4), checked, and those left open
        for matching. Beside `return update(...)`, the positions are the items of the value
        it gives, unless the whole value is the one state parameter named."""
        first, state_at = self.first, self.state_at
        if state_at and first is not None and first.kind == "single":
            out = self.evaluate()
            if (
                _matching.unpackable(out)
                and not isinstance(out, dict)
                and not (
                    set(state_at.values()) == {0}
                    and all(same_value(self.values[p], out) for p in state_at)
                )
            ):
                self.unpacked, self.named = len(out), _matching.named_tuple(out)
                first = dataclasses.replace(
                    first, kind="tuple", names=(None,) * self.unpacked, gradients=(), updates=()
                )
                self.first = first
        arity = 0 if first is None or first.kind == "none" else len(first.names)
        for p, pos in state_at.items():
            if pos >= arity:
                raise error(
                    OptionError,
                    STATE_POSITION,
                    self.analysis,
                    param=p,
                    pos=pos,
                    returns="; ".join(r.describe() for r in self.analysis.returns) or "no return",
                    count=f"{arity} value{'s' if arity != 1 else ''}"
                    + (" (the items of the tuple its expression gives)" if self.unpacked else ""),
                )
        if first is not None and first.kind != "none":
            # A position naming a parameter away from its state position (`return p, p`) is
            # a per-step output, never another parameter's new value.
            taken = set(self.returned_at.values()) | set(state_at.values())
            taken |= repeated_at(self.analysis, self.options)
            self.open_positions = [pos for pos in range(len(first.names)) if pos not in taken]

    def match_state(self) -> None:
        """State by abstract value (rule 3), Python counters (rule 8), and the parameters some
        returns give back by name (`named_in_some`)."""
        options, values, num_steps = self.options, self.values, self.num_steps
        # Candidates: open broadcast-like arguments and declared state. A method's pytree
        # instance given back changed (`return self.replace(w=w), loss`, the flax.struct
        # agents of jaxrl_m) is state; left broadcast, every step restarted from it.
        # A value a functools.partial binds is the same every call: never given back (rule 10).
        candidates = [
            p
            for p in self.params
            if p not in options.bound
            and (
                p in self.declared
                or _candidate(self.kinds.get(p), values[p], num_steps)
                or (p == options.instance and p not in options.broadcast and _has_arrays(values[p]))
            )
        ]
        self.pending = [p for p in candidates if p not in self.state_at]
        # Python numbers static with num_steps > 1, which a return may give back changed.
        numbers = [
            p
            for p in self.params
            if num_steps > 1
            and p not in options.bound
            and self.kinds.get(p) == "static"
            and type(values[p]) in (int, float)
            and self.for_eval[p] == "static"
        ]
        # Named in some returns, another expression at that position in others (`return p, s,
        # loss` in a branch, `return new_p, new_s, loss`): that position is its place.
        partly = {
            p: pos
            for p, pos in named_in_some(self.analysis, options).items()
            if p not in self.state_at
        }
        first = self.first
        if (self.pending or numbers or partly) and self.open_positions and first is not None:
            self._match_by_value(first, numbers, partly)

    def _match_by_value(self, first: Return, numbers: list[str], partly: dict[str, int]) -> None:
        out = self.evaluate()
        outputs = positions_of(first, out)
        for p, pos in partly.items():
            if not same_value(self.values[p], outputs[pos]):
                raise _matching.disagree(self.analysis, p, pos)
            self.matched[p] = (
                pos,
                f"matched by value to return position {pos}, returned by name there in some "
                "returns",
            )
        self.pending = [p for p in self.pending if p not in self.matched]
        self.open_positions = [pos for pos in self.open_positions if pos not in partly.values()]
        counters, by_value = self._settle(first, outputs, self.open_positions, numbers)
        if (
            not (counters or by_value)
            and first.kind == "single"
            and not first.derivative
            and _matching.unpackable(out)
        ):
            # `return update(params, opt_state, batch)`, `return {"params": ..., ...}`: no
            # parameter is the whole value, so its items may be the return positions, as if
            # the step returned them one by one; only where the step's data flow says so
            # (some item's last operation takes its parameter's own arrays, `p + u`), not for
            # `return jax.value_and_grad(loss)(params, x)`, whose gradients look like params
            # (and whose last operation may take them: the gradient of `p ** 2`).
            each = dataclasses.replace(
                first, kind="tuple", names=(None,) * len(out), gradients=(), updates=()
            )
            if isinstance(out, dict):  # its keys sorted, as `jax.jit` returns the dict
                keys = tuple(sorted(out))
                names = tuple(k if isinstance(k, str) else None for k in keys)
                each = dataclasses.replace(each, names=names, keys=keys)
            contents = positions_of(each, out)
            # In the step's own order: of items giving back the very same value (`{"params":
            # p, "log": p}`), the first it writes is the state (`matching.match`).
            items = [each.keys.index(k) for k in out] if each.keys else list(range(len(contents)))
            found, by_value = self._settle(each, contents, items, numbers)
            direct = self.flow_of(each)() if by_value else []
            if any(p in direct[pos].direct for p, (pos, _) in by_value.items()):
                counters, self.unpacked, self.first = found, len(contents), each
                self.keys, self.named = each.keys, _matching.named_tuple(out)
                self.open_positions, outputs = items, contents
            else:
                by_value = {}
        self.matched.update(by_value)
        self.by_value = {p: pos for p, (pos, _) in by_value.items() if p not in self.declared}
        self.counters = counters
        self.outputs = outputs

    def whole_return(self) -> None:
        """With num_steps > 1, where nothing else is given back: a tuple argument the whole
        return gives back item by item (`nesting.whole_carry`) is state at the one position
        that return becomes (`return (params, state)`), as `jax.jit` callers pass it back."""
        first, outputs = self.first, self.outputs
        if first is None or not outputs or self.num_steps == 1:
            return
        if self.given_back() or self.returned_at or self.gradients():
            return
        p = whole_carry(
            self.values, self.pending, first, outputs, self.flow_of(first),
            lambda p, q: self.new_value_of(p, q, True),
        )  # fmt: skip
        if p is None:
            return
        self._added = None  # (read at the tuple's positions)
        self.whole = True
        self.first = dataclasses.replace(
            first, kind="single", names=(None,), gradients=(), updates=()
        )
        self.matched[p] = (0, "the whole return: its items are the tuple's, one by one")
        self.pending.remove(p)
        self.open_positions, self.outputs = [], [tuple(outputs)]

    def carried(self) -> list[str]:
        """The parameters that could come back through a return, in order: not a method's
        instance, those named broadcast= or bound by a functools.partial, or state written
        back into the caller's objects (counted, a step's `(self, w, x)` put `w` at the second
        place)."""
        options = self.options
        return [
            p
            for p in self.params
            if self.for_eval[p] not in ("scanned", "static")
            and p not in options.broadcast
            and p not in options.bound
            and p != options.instance
            and p not in self.mutable
        ]

    def flow_of(self, returned: Return) -> Callable[[], Any]:
        """Per return position of `returned`, the parameters it is computed from and those
        the last operation making it takes (`flow.flows`), read once when first asked. A
        step that fails so is evaluated first, which asks about an argument it fails on
        sliced (`_probe_sliced`) rather than leave JAX's error bare."""

        def read() -> list[Flow]:
            if returned not in self._flows:
                try:
                    self._flows[returned] = flows(
                        self.fn,
                        self.params,
                        self.values,
                        self.for_eval,
                        self.num_steps,
                        lambda o: positions_of(returned, o),
                    )
                except AutoflatError:
                    raise
                except Exception:
                    self.evaluate()  # (the same roles: it fails too, and asks where it can)
                    raise
            return self._flows[returned]

        return read

    def _settle(
        self, returned: Return, outs: list[Any], positions: list[int], numbers: list[str]
    ) -> tuple[dict[str, int], dict[str, tuple[int, str]]]:
        """Python counters first (they take a place among the parameters only if carried),
        then the candidates by value (`matching.match`)."""
        params, values, carried = self.params, self.values, self.carried()
        places = _matching.places([p for p in params if p in carried or p in numbers], returned)
        found = counters(
            self.analysis, self._traced(returned), self.num_steps, numbers, values, positions,
            outs, places, returned.names,
        )  # fmt: skip
        found.update(
            accumulated(
                self.analysis, self._traced(returned), values, self.num_steps, returned.names,
                outs, positions, numbers, places, found,
            )
        )  # fmt: skip
        left = [pos for pos in positions if pos not in found.values()]
        places = _matching.places([p for p in params if p in carried or p in found], returned)
        # Several parameters alike, as many positions: settled by data flow, then names.
        alike = functools.partial(
            _matching.settle_alike, names=returned.names, flow=self.flow_of(returned)
        )
        by_value = _matching.match(
            self.analysis, params, values, self.pending, left, outs, self.declared, places,
            alike, self.flow_of(returned), returned.names, self.gradients(),
        )  # fmt: skip
        for pos, at, by in returned.updates:
            p = next((p for p in at if by_value.get(p, (None,))[0] == pos), None)
            if p is not None and (
                any(is_optax(look_up(self.fn, self.values, o)) for b in by for o in b.split("|"))
                or p not in self.flow_of(returned)()[pos].direct
            ):
                # An optimizer's updates at `p`'s gradients (`updates, opt_state =
                # tx.update(grads, opt_state)`): optax's, or any whose last operation does
                # not take `p`'s own arrays; not a hand-written optimizer's `p - lr * g`.
                del by_value[p]
        instance = self.options.instance
        if (
            instance in by_value
            and instance not in self.flow_of(returned)()[by_value[instance][0]].direct
        ):
            # A method's instance only where some leaf is its own, or computed by an
            # operation taking its own arrays (`self.replace(w=self.w - g)`), not for
            # gradients alike it (`return loss, self.loss_and_grad(x)[1]`).
            del by_value[instance]
        return found, by_value

    def _traced(self, returned: Return) -> Callable[..., list[Flow] | None]:
        """`flow.flows_traced` of the step at `returned`'s positions, given the numbers
        to trace (and the operations counted as sums)."""
        return functools.partial(
            flows_traced, self.fn, self.params, self.values, self.for_eval, self.num_steps,
            lambda o: positions_of(returned, o),
        )  # fmt: skip

    def gradients(self) -> dict[int, set[str]]:
        """Per return position, the parameters it returns gradients taken at (`return loss,
        grads` after `jax.value_and_grad(loss)(params, x)`): never their new value (at
        num_steps > 1, carrying them as params trained on the gradients). A previous gradient
        may be state."""
        gradients: dict[int, set[str]] = {}
        for r in self.analysis.returns:
            for pos, at in r.gradients:
                gradients.setdefault(pos, set()).update(at)
        return gradients

    def only_gradients(self) -> set[int]:
        """The return positions where every `return` gives gradients (`gradients`); none
        where the positions are the items of one returned value."""
        if self.unpacked:
            return set()
        returns = [r for r in self.analysis.returns if r.kind != "none"]
        held = [{pos for pos, _ in r.gradients} for r in returns]
        return set.intersection(*held) if held else set()

    def match_promoted(self) -> None:
        """Rule 3 for a weakly typed leaf (made from a Python number) that the step gives
        back promoted (`total + loss` from `jnp.asarray(0)`, a dict of episode counters
        summing float32 rewards): matched, as `lax.scan` promotes such a carry, where the
        position is that parameter's new value by more than its value (`new_value_of`);
        a bare array only at its place. (A metrics tuple alike a weakly typed pair of clip
        bounds is not their new value.)"""
        first, outputs = self.first, self.outputs
        if first is None or not outputs:
            return
        given = self.given_back(counters=False)
        taken = set(given.values())
        left = [pos for pos in self.open_positions if pos not in taken]
        carried = self.carried()
        places = _matching.places([p for p in self.params if p in carried], first)
        for p in self.pending:
            value = self.values[p]
            if p in given or p in self.matched:
                continue
            bare = jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))
            spots = [places[p]] if bare and p in places else [] if bare else list(left)
            for pos in spots:
                if (
                    pos in left
                    and not same_value(value, outputs[pos])
                    and same_value(value, outputs[pos], promote=True)
                    and self.new_value_of(p, pos, narrowed(value, outputs[pos]))
                ):
                    self.matched[p] = (
                        pos,
                        f"matched by value to return position {pos}, weakly typed leaves "
                        "promoted as lax.scan promotes a carry",
                    )
                    left.remove(pos)
                    break

    def new_value_of(self, p: str, pos: int, additions_only: bool = False) -> bool:
        """Evidence beyond its value that return position `pos` is `p`'s new value: made by
        an addition whose first operand is `p`'s own array (`p - lr * g`, `total + loss`,
        `0.9 * ema + 0.1 * loss`); unless `additions_only` (a weakly typed float given back
        in a narrower float, `jax.jit`'s bfloat16 from a float32 `ema`: loss weights `{"ce":
        1.0}` beside a bfloat16 model's loss parts look alike), also returned under `p`'s
        own name or it with a word for new (`new_total`) and computed from `p`, or a tree
        with named parts (a dict, a named tuple, a dataclass) computed from `p` (a dict of
        counters updated by `(n + r) * (1 - done)`)."""
        first = self.first
        assert first is not None
        if self._added is None:
            self._added = flows(
                self.fn, self.params, self.values, self.for_eval, self.num_steps,
                lambda o: positions_of(first, o), additions=True,
            )  # fmt: skip
        if any(p in takes for takes in self._added[pos].takes):
            return True
        if additions_only:
            return False
        if first.kind == "tuple" and _names.renamed(p, pos, first.names):
            return p in self.flow_of(first)()[pos].sources  # (`new_total = loss + total`)
        return has_named_parts(self.values[p]) and p in self.flow_of(first)()[pos].sources

    def result(self) -> Inferred:
        """The table applied with all the first call found, and the scalars made arrays."""
        call = dataclasses.replace(
            self.call,
            matched=self.matched,
            state_at=self.state_at,
            counters=self.counters,
            concrete=self.concrete,
            unpacked=self.unpacked,
            whole=self.whole,
            keys=self.keys,
            named=self.named,
        )
        roles = assign_roles(self.analysis, self.options, call)
        if self.num_steps > 1 and self.outputs:
            roles = dataclasses.replace(roles, echoes=self._echoes(roles))
        if self.call.may_mutate:
            kinds = dict(zip(roles.params, roles.roles, strict=True))
            refuse_nested_modules(
                self.analysis, self.fn, kinds, roles.written_back, self.values, self.num_steps
            )
        positions = {**self.given_back(), **self.returned_at}
        to_array = scalars_to_array(
            self.fn, roles, self.values, positions, self.for_eval, self.num_steps, self.out,
            self.first,
        )  # fmt: skip
        return Inferred(roles, to_array)

    def _echoes(self, roles: Roles) -> tuple[tuple[str, int], ...]:
        """`Roles.echoes`: each argument broadcast by its shapes and the first per-step output
        position whose one-step value could be its new value (promoted as `lax.scan` would)."""
        outputs, entries = self.outputs or [], roles.layout.entries
        found = []
        for p, role, rule in zip(roles.params, roles.roles, roles.rules, strict=True):
            if role != "broadcast" or rule != "no-leading-axis" or p not in self.values:
                continue
            pos = next(
                (
                    q
                    for q, out in enumerate(outputs)
                    if q < len(entries)
                    and entries[q][0] == "out"
                    and same_value(self.values[p], out, promote=True)
                ),
                None,
            )
            if pos is not None:
                found.append((p, pos))
        return tuple(found)


def _has_arrays(value: Any) -> bool:
    """A pytree node (not a leaf) with array leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return not jax.tree_util.treedef_is_leaf(treedef) and any(is_array(x) for x in leaves)


def _candidate(kind: Role | None, value: Any, num_steps: int) -> bool:
    """Whether an open argument may turn out to be state returned under another name: with
    num_steps > 1 what is the same every step; with 1, containers and modules (a bare array
    gains nothing from being state at one step a call, and is returned as it is)."""
    if kind not in ("scanned", "broadcast"):
        return False
    if num_steps > 1:
        return kind == "broadcast"
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))
