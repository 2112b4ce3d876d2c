"""The one error family of autoflat, the long messages it raises with, and how they are made.

Every message names the user's function (by its `__qualname__`, the rule everywhere) and its
file and line, says what is wrong, and shows code that works. The messages live here as
module-level templates so they can be read (and tested) in one place; `error()` fills one in
with the function's name and location and returns the exception of the right kind.

The kinds are `AutoflatError` subclasses that are also the standard exception a caller would
catch for that mistake, as `jax.jit` raises them: arguments that do not fit the signature are a
`TypeError`, a value of the wrong shape or an option out of range a `ValueError`.

The classes and `error()` come first, then only messages, a section per stage of the step's
life: analysis, options and the decorator, roles, the call, handles and write-back, Flax NNX,
feeding.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class AutoflatError(Exception):
    """Raised for anything autoflat cannot do with the function or values it was given.

    The caller's model and optimizer state are never consumed when this is raised: they can be
    passed again, to the fixed step or to `jax.jit`. Catch a subclass to tell the kinds apart.
    """


class SourceError(AutoflatError):
    """The step's source cannot be read or transformed (a lambda, `yield`, returns that
    disagree, a file edited since import)."""


class OptionError(AutoflatError, ValueError):
    """`autoflat.step(...)` was given an option that does not fit the function."""


class CallError(AutoflatError, TypeError):
    """A call's arguments do not fit the step: they do not bind to its signature, or a static
    argument cannot be hashed; or an autoflat function was given something not a step."""


class ShapeError(AutoflatError, ValueError):
    """Per-step inputs or state have shapes a k-step call cannot run (a missing or wrong
    leading axis, state that changes its structure from step to step)."""


class StateError(AutoflatError, ValueError):
    """State that cannot be carried or written back as the step asks (an immutable value the
    step mutates, a Flax NNX Variable reachable twice)."""


class ConsumedError(AutoflatError, RuntimeError):
    """A handle whose buffers were donated to a later call was used (as JAX raises a
    `RuntimeError` for a deleted array)."""


for _cls in (
    AutoflatError,
    SourceError,
    OptionError,
    CallError,
    ShapeError,
    StateError,
    ConsumedError,
):
    _cls.__module__ = "autoflat"


class Located(Protocol):
    """What a message needs of the function it is about: its qualified name and `file:line`.
    `Analysis` (stage 1) has both; so does everything made from it."""

    @property
    def name(self) -> str: ...

    @property
    def where(self) -> str: ...


class Location(NamedTuple):
    """A `Located` for messages raised before there is an `Analysis` (the source unread)."""

    name: str
    where: str


def where(filename: str, line: int) -> str:
    """`file:line` as shown in messages (the full file name, as tracebacks show it)."""
    return f"{filename}:{line}"


def error(kind: type[AutoflatError], template: str, fn: Located, **fields: Any) -> AutoflatError:
    """The exception of `kind` with `template` filled in: `{name}` and `{where}` from `fn`,
    the rest from `fields`. Use as `raise error(ShapeError, BAD_SCAN_LENGTH, analysis, ...)`."""
    return kind(template.format(name=fn.name, where=fn.where, **fields))


# -- Analysis: the step's source and what wraps it (`_analysis`).

NO_SOURCE = """\
autoflat cannot read the source of `{name}` (defined at {where}): {reason}.

autoflat rewrites the Python source of the step function, so it needs a function defined with
`def` in a file (not a lambda, not code typed at a REPL or run through `exec`). Write it as:

    @autoflat.step(num_steps=10)
    def update(model, opt_state, batch):
        ...
        return model, opt_state, loss
"""

BOUND_RETURNED = """\
`{name}` ({where}) returns `{param}`, which a functools.partial binds: a bound value is the \
same on every call, so the step's new value of `{param}` could never reach a later step (under \
jax.jit, every call would start again from the bound value). Pass `{param}` at the call \
instead, and bind only what stays the same (a schedule, an optimizer, constants).
"""

BOUND_VARIADIC = """\
`autoflat.step(...)` for `{name}` ({where}): a functools.partial binds {what} into \
`{star}{param}`, which takes one role for what the partial binds and what each call passes. \
With num_steps > 1 that role could slice a bound value per step, where jax.jit of the partial \
holds it the same on every call. Bind it to a named parameter before `{star}{param}`, or \
give all of `{param}` its role:

    @autoflat.step(..., broadcast="{param}")   # the same for every step
    @autoflat.step(..., per_step="{param}")    # sliced along the first axis, bound values too
"""

BOUND_STATE = """\
`autoflat.step(...)` for `{name}` ({where}): state= names `{param}`, which a functools.partial \
binds: a bound value is the same on every call, so its new value could never reach a later \
step. Pass `{param}` at the call instead.
"""

UNSUPPORTED = """\
`{name}` ({where}) uses {construct}, which autoflat cannot run inside a compiled step.

{advice}"""

UNSUPPORTED_ADVICE = {
    "yield": "A step function runs once per step and returns its results: replace `yield` by "
    "`return`, and build any sequence of per-step values as the step's outputs (autoflat "
    "stacks them along a leading axis).",
    "async": "A step function must be an ordinary `def`: remove `async`/`await` (JAX dispatch "
    "is already asynchronous).",
    "global": "Writing module globals from a compiled step happens only while tracing, not on "
    "every step. Return the value instead:\n\n    return model, opt_state, new_value",
    "nonlocal": "Writing a variable of an enclosing function from a compiled step happens only "
    "while tracing, not on every step. Return the value instead:\n\n"
    "    return model, opt_state, new_value",
    "starred": "autoflat needs to know at each `return` which position is which, before the "
    "step runs. Return every element by itself, or the extras as one tuple:\n\n"
    "    return p, a, b\n    return p, extras",
}

RETURNS_DISAGREE = """\
The `return` statements of `{name}` ({where}) disagree: {first} but {second}.

autoflat needs every `return` of a step function to have the same shape, with the state it
carries from step to step at the same positions, for example:

    if cond:
        return model, opt_state, loss
    return model, opt_state, jnp.zeros_like(loss)
"""

WRAPPED_STEP = """\
`{name}` ({where}) is wrapped by `{wrapper}` under `@autoflat.step`. autoflat regenerates \
the step from its source, so that wrapper would silently not run. Put `@autoflat.step` \
directly on the `def` and apply other decorators above it, or do the wrapper's work in the \
body:

    @other_decorator
    @autoflat.step(num_steps=10)
    def update(...): ...

(`jax.jit`, `eqx.filter_jit` and `nnx.jit` without options may stay under it: autoflat compiles
the step itself.) A type checker's decorator (jaxtyping's `@jaxtyped`, `@beartype`) takes a
plain function, and with `num_steps > 1` the step's arguments carry the steps' axis: keep it
on the functions the step calls (a checked loss function) instead.
"""

JIT_OPTIONS = """\
`{name}` ({where}) is wrapped by `{wrapper}` with {options} under `@autoflat.step`, which \
autoflat would drop (it compiles the step itself). Remove the inner `{wrapper}` and give \
autoflat the options it takes: `static_argnames=` for static arguments (a `jax.jit`'s own are \
taken over by name); autoflat donates the state it produced on its own (`donate=`); shardings \
come from the arguments you pass.
"""

# -- Options and the decorator: `autoflat.step(...)`, `@autoflat.step`, the public functions.

BAD_OPTION = """\
`autoflat.step(...)` for `{name}` ({where}): {what}.

The parameters of `{name}` are: {params}.
"""

ROLE_CONFLICT = """\
`autoflat.step(...)` for `{name}` ({where}): parameter `{param}` is given two roles, \
{first} and {second}. Give each parameter at most one of state=, broadcast=, static_argnames=.
"""

BAD_NAMES = """\
`autoflat.step(...)` for `{name}` ({where}): {option}= takes a parameter name or a sequence of \
names, got {value!r}.
"""

BAD_NUM_STEPS = """\
`autoflat.step(...)` for `{name}` ({where}): num_steps must be an int >= 1, got {value!r}.
"""

BAD_PACK = """\
`autoflat.step(...)` for `{name}` ({where}): pack must be False, True or "auto", got {value!r}.
"""

BAD_FLAG = """\
`autoflat.step(...)` for `{name}` ({where}): {option} must be {allowed}, got {value!r}.
"""

DECORATOR_ORDER = """\
`@autoflat.step` was applied to a {wrapper} object (`{name}`, {where}). Put `@{wrapper}` above \
`@autoflat.step`, so autoflat transforms the function itself:

    @{wrapper}
    @autoflat.step(num_steps=10)
    def update(...): ...
"""

NOT_A_STEP = """\
autoflat.{api} expected a function decorated with @autoflat.step, got {value!r}.
"""

# -- Roles: what the first call's values and the source say each parameter is (`_roles`).

PER_STEP_OR_STATE = """\
Calling `{name}` ({where}) with num_steps={num_steps}: every array of `{param}` has a leading \
axis of {num_steps}, so it looks like a per-step input, but return position {position} gives back \
{given}. If `{param}` is state \
whose first axis happens to be {num_steps}, slicing it per step would train the wrong thing. \
Say which it is:

    @autoflat.step(num_steps={num_steps}, state="{param}")      # carried from step to step
    @autoflat.step(num_steps={num_steps}, per_step="{param}")   # one slice per step
"""

SLICED_FAILS = """\
Calling `{name}` ({where}) with num_steps={num_steps}: every array of `{param}` has a leading \
axis of {num_steps}, so it is read as a per-step input, one slice a step; so sliced, the step \
fails to trace ({error}), and carried whole, as state, it traces. If `{param}` is state whose \
first axis happens to be {num_steps} (an ensemble of {num_steps}), say so; if it is a per-step \
input, the error is the step's own (per_step= shows it):

    @autoflat.step(num_steps={num_steps}, state="{param}")      # carried from step to step
    @autoflat.step(num_steps={num_steps}, per_step="{param}")   # one slice per step
"""

WRITTEN_PER_STEP = """\
Calling `{name}` ({where}) with num_steps={num_steps}: the body writes into `{param}` (line \
{line}), which makes it state, carried from step to step and written back into your object; \
but every array of `{param}` has a leading axis of {num_steps}, as a per-step input has. \
Carried as state, each step would see all {num_steps} steps' values. Say which it is:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")   # a per-step input, changed \
locally (as under jax.jit)
    @autoflat.step(num_steps={num_steps}, state="{param}")      # state whose first axis is \
{num_steps}
"""

RETURNED_PER_STEP = """\
Calling `{name}` ({where}) with num_steps={num_steps}: `{param}` is returned by name (return \
position {pos}), which makes it state; the body never changes it, so carried as state it \
would come back as it came in, and each step would see all {num_steps} steps' values. But \
every array of `{param}` has a leading axis of {num_steps}, as a per-step input has \
(returned to log it?). Say which it is:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")   # each step its slice; \
position {pos} stacks them (as given)
    @autoflat.step(num_steps={num_steps}, state="{param}")      # the whole array every step
"""

REBOUND_PER_STEP = """\
Calling `{name}` ({where}) with num_steps={num_steps}: `{param}` is returned by name (return \
position {pos}), which makes it state, and the body binds it again from `{param}` alone \
(nothing of the step's per-step inputs or other state, as a batch normalised is). But \
every array of `{param}` has a leading axis of {num_steps}, as a per-step input has (a batch \
transformed and returned to log it?). Carried as state, each step would see all {num_steps} \
steps' values, transformed again every step. Say which it is:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")   # each step its slice; \
position {pos} stacks what each step made of it (as under jax.jit)
    @autoflat.step(num_steps={num_steps}, state="{param}")      # state whose first axis is \
{num_steps}
"""

PER_STEP_AFTER_BROADCAST = """\
Calling `{name}` ({where}) with num_steps={num_steps}: `{param}` was taken as the same for \
every step (broadcast) by its shapes at the first call ({first}). Now it holds {shape}, with \
a leading axis of {num_steps} = num_steps: read as broadcast, every step would see the whole \
chunk. Say which it is:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")    # sliced along the first axis
    @autoflat.step(num_steps={num_steps}, broadcast="{param}")   # the same for every step
{echo}"""

PER_STEP_FED_BACK = """\
Calling `{name}` ({where}) with num_steps={num_steps}: `{param}` holds what {at} gave back \
at an earlier call, passed in again. `{param}` was read as a per-step input by its shapes at \
the first call (a leading axis of {num_steps} = num_steps), so that call gave each step one \
row of it and stacked what each step gave back there, a value of `{param}`'s own shapes. If \
`{param}` is carried from step to step (an episode return per environment, a recurrent state, \
running statistics), that reading was wrong: that call's results, its new state too, are \
not what the step carried gives. Carry it, and start again from a state made before that call:

    @autoflat.step(num_steps={num_steps}, {option})   # carried from step to step

If each step does take one row of it, and the rows it gives back are its input next call, \
say so:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")
"""

COUNTER_BY_NUM_STEPS = """\
Calling `{name}` ({where}) with num_steps={num_steps}: `{param}` went from {before} to {now} \
since the last call, num_steps apart: a step counter, it seems. A Python int is static with \
num_steps > 1, the same for every step of a call: each of the last call's {num_steps} steps saw \
`{param}` = {before}, where {num_steps} calls of the step under jax.jit see {before} to {last}, \
and every new value compiles again. Give each step its own (a leading axis of num_steps makes \
it per-step, traced: one compile):

    step(..., jnp.arange({param}, {param} + {num_steps}), ...)

or, if every step of a call is to see the same value, say so:

    @autoflat.step(num_steps={num_steps}, broadcast="{param}")         # traced: one compile
    @autoflat.step(num_steps={num_steps}, static_argnames="{param}")   # compiled per value

(static_argnames= also where the step needs `{param}` as a concrete value: a shape, a branch.)
"""

# PER_STEP_AFTER_BROADCAST's third reading (`Roles.echoes`).
PER_STEP_ECHO = """\

Or it is what return position {pos} gives back, passed in again: that position could be \
`{param}`'s new value (a running sum, `loss + {param}`), stacked as a per-step output since \
`{param}` was read as broadcast. If each step's `{param}` is what position {pos} gave back \
the step before, carry it (then pass back what the call returns there):

    @autoflat.step(num_steps={num_steps}, state={{"{param}": {pos}}})
"""

MIXED_ARGUMENT = """\
Calling `{name}` ({where}) with num_steps={num_steps}: some array leaves of `{param}` have a \
leading axis of {num_steps} (one entry per step) and others do not: `{path}` is {shape}. \
autoflat cannot tell whether `{param}` is a per-step input or the same for every step. Split \
it into two arguments, or say which it is:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")    # sliced along the first axis
    @autoflat.step(num_steps={num_steps}, broadcast="{param}")   # the same for every step
    @autoflat.step(num_steps={num_steps}, state="{param}")       # its new value is returned
"""

MIXED_VARIADIC = (
    MIXED_ARGUMENT
    + """
`{param}` is `{star}{param}`: its items take one role together. To give each its own, name \
them as parameters (`def step(model, x, y, lr)`, not `def step(model, *batch)`).
"""
)

RAW_KEY_OR_PER_STEP = """\
Calling `{name}` ({where}) with num_steps=2: `{path}` is uint32[2], which is a raw PRNG key \
(`jax.random.PRNGKey(0)`, the same for every step) or two steps' uint32 values (one per \
step): autoflat cannot tell which. Say which it is:

    @autoflat.step(num_steps=2, broadcast="{param}")   # a key, the same for every step
    @autoflat.step(num_steps=2, per_step="{param}")    # one value per step

(or use a typed key, `jax.random.key(0)`, which is never taken for per-step data)
"""

SHORT_FIRST_CHUNK = """\
Calling `{name}` ({where}) with num_steps={num_steps}: no argument has a leading axis of \
{num_steps}, and every array of `{param}` has a leading axis of {length}. This first call is \
either a short chunk of {length} steps or one value reused by every step (a full batch); \
autoflat will not guess. Say which:

    @autoflat.step(num_steps={num_steps}, per_step="{param}")    # {length} steps, one slice each
    @autoflat.step(num_steps={num_steps}, broadcast="{param}")   # the same `{param}` each step
    @autoflat.step(num_steps={num_steps}, state="{param}")       # its new value is returned

or pass a first chunk of {num_steps} steps (shorter final chunks are fine after it).
"""

AMBIGUOUS_STATE = """\
`{name}` ({where}): {what}, with the same tree structure, shapes and dtypes{by_name}: \
autoflat cannot tell which position, if any, gives back the new value of which parameter. Say \
it, naming each parameter the step trains with the return position of its new value:

    @autoflat.step(..., state={{{example}}})

(a parameter passed in and left unchanged, such as a teacher's weights, is not state: \
`broadcast="name"`), or return the state by name (`new = ...` then `return new, ...` where \
the parameter is called `new`).
"""

ARRAY_AT_ITS_PLACE = """\
`{name}` ({where}): return position {pos} ({returned}, {how} `{param}`) could be the new value \
of `{param}`: it has the shape and dtype of `{param}`, a bare array, and sits at the place among \
the returns that `{param}` has among the parameters that could be state. {link}, so autoflat \
cannot tell whether `{param}` is the same every step (a learning rate or a weight decay beside \
a loss) or is carried, each step starting from what that position gave back the step before \
(a `prev_loss` overwritten by `loss`). If it is the same every step, as a learning rate is:

    @autoflat.step(..., broadcast="{param}")

or pass it as a Python float (static: a new value compiles a new version). Only if each step's \
`{param}` is what return position {pos} gave back at the step before:

    @autoflat.step(..., state={{"{param}": {pos}}})
{reordered}"""

NUMBER_ADDED = """\
`{name}` ({where}): return position {pos} is a scalar made by adding to `{param}` (a Python \
{type}, {value} at this call), and {placed}. With num_steps={num_steps}, autoflat cannot \
tell a running sum carried from step to step and resumed from {value} from a constant the \
step adds a per-step value to (`eps + loss`). If it is a running sum, carried as a \
`lax.scan` carries it:

    @autoflat.step(..., state={{"{param}": {pos}}})

If it is the same every step:

    @autoflat.step(..., static_argnames="{param}")
"""

NUMBER_RENAMED = """\
`{name}` ({where}): return position {pos} gives back `{returned}`, a Python {type} ({value} at \
this call, where `{param}` is {old}), at the place `{param}` has among the parameters that \
could be state, under another name. With num_steps={num_steps}, autoflat cannot tell \
`{param}`'s new value, carried to the next step, from a number computed from it and given \
back for each step (a learning rate decayed from `base_lr`, logged). If the next step should \
start from it:

    @autoflat.step(..., state={{"{param}": {pos}}})

If `{param}` is the same every step (position {pos} is stacked, one value a step):

    @autoflat.step(..., static_argnames="{param}")

(A number given back under its own name or it with `new` or `next`, `new_{param}`, or as its \
int plus one, is carried without asking.)
"""

PASSED_THROUGH = """\
`{name}` ({where}) returns `{param}` by name at return position {pos}, and never assigns \
`{param}` in the body: that position gives back `{param}` as it came in. Position {pos} is also \
the place of `{other}` among the parameters that could be state, and `{other}` has the tree \
structure, shapes and dtypes of `{param}`. With num_steps={num_steps} the two readings train \
differently, so autoflat will not choose:

- as a `lax.scan` carry `({order})`, by position: return position {place} is the new `{param}` \
and `{other}` takes the old `{param}` (a previous value kept for momentum or lookahead):

    @autoflat.step(..., state={{"{param}": {place}, "{other}": {pos}}})

- `{param}` is the same every step (passed through to the output), and return position \
{place} is the new `{other}`:

    @autoflat.step(..., state={{"{other}": {place}}}, broadcast="{param}")
"""

STATE_NESTED = """\
`{name}` ({where}): `{param}` comes back inside return position {pos}, at `{path}`, not at a \
position of its own. With num_steps={num_steps}, autoflat carries state from one step to the \
next only at return positions (the returned tuple's items, and the items of a tuple written \
in it with a parameter's name among them): `{param}` would be taken as a broadcast input, and \
every step would start again from the value you passed in. Return it at its own position, or \
under its parameter's name in a tuple written there in every `return` (autoflat looks into \
a tuple only where each `return` writes one at that position):

    return {param}, ...
    return ({param}, ...), ...

(and unpack the call's result the same way), or use num_steps=1. If `{param}` is the same \
every step and that value only computed from it: @autoflat.step(..., broadcast="{param}").
"""

STATE_SPREAD = """\
`{name}` ({where}): the items of `{param}` have the abstract values of return positions {at}, \
inside the tuple written at `{path}` of the `return` (autoflat looks into it: a parameter's \
name is among its items), but no position gives `{param}` back whole. With \
num_steps={num_steps}, `{param}` would be taken as a broadcast input, every step starting \
again from the value you passed in, and those items stacked as outputs. If they are \
`{param}`'s new value, write them as a tuple of their own where they are in the `return`, \
`({items})`, as `{param}` came in; if `{param}` is the same every step:

    @autoflat.step(..., broadcast="{param}")
"""

STATE_SPREAD_FLAT = """\
`{name}` ({where}): the items of `{param}` come back one by one at return positions {at}, \
each computed from `{param}`, but no position gives `{param}` back whole. With \
num_steps={num_steps}, `{param}` would be taken as a broadcast input, every step starting \
again from the value you passed in, and those items stacked as outputs. If they are \
`{param}`'s new value, give it back as one value, a tuple written at one position of the \
`return` (`return ({items}), ...`), or make its items parameters of their own; if `{param}` \
is the same every step:

    @autoflat.step(..., broadcast="{param}")
"""

STATE_TYPE_CHANGED = """\
`{name}` ({where}): return position {pos} has the leaf shapes of `{param}`, but not its \
{what} ({detail}), so it is not taken for the new `{param}`: with num_steps={num_steps}, \
`{param}` would then be the same every step and position {pos} stacked, each step starting \
again from the value passed in. If position {pos} is the new `{param}`: a `lax.scan` carry \
keeps its types, so give it back as it came in ({fix}); autoflat then carries it. If \
`{param}` is the same every step and position {pos} is something else:

    @autoflat.step(..., broadcast="{param}")
"""

STATE_UNLINKED = """\
`{name}` ({where}): return position {pos} has the tree structure, shapes and dtypes of \
`{param}`, but {why}: only its type says it is `{param}`'s new value (a metrics tuple can \
look like a pair of clip bounds, gradients like a teacher's parameters). With \
num_steps={num_steps} the reading matters: as state, each step starts from what the one \
before gave back at position {pos}; as broadcast, each step starts from the value passed in \
and position {pos} is stacked. Say which:

    @autoflat.step(..., state={{"{param}": {pos}}})  # position {pos} is the new `{param}`
    @autoflat.step(..., broadcast="{param}")  # `{param}` is the same every step
"""

STATE_AWAY_FROM_PLACE = """\
`{name}` ({where}): return position {pos} ({returned}) is {how} and has its shape and \
dtype, but is not at `{param}`'s place among the \
returns (position {place}: its rank among the parameters that could be state, those named \
broadcast= left out), where a bare array is matched. With num_steps={num_steps} the reading \
matters: as state, each step starts from what the one before gave back at position {pos}; as \
broadcast, each step starts from the `{param}` passed in (a step counter stays at its first \
value) and position {pos} is stacked. Say which:

    @autoflat.step(..., state={{"{param}": {pos}}})  # position {pos} is the new `{param}`
    @autoflat.step(..., broadcast="{param}")  # `{param}` is the same every step
"""

STATE_NOT_MATCHED = """\
`{name}` ({where}): `{param}` is named in state= but no `return` gives back a value with its \
tree structure, shapes and dtypes ({returns}), and the body does not assign into it. State \
must come back from every step, or it would be carried unchanged. Return its new value:

    {param} = ...
    return {param}, ...

or say at which return position it comes back: `state={{"{param}": 0}}`. If it is the same \
for every step, pass it as broadcast="{param}" instead.
"""

STATE_AT_NESTED = """\
`{name}` ({where}): state= says `{param}` comes back at return position {pos}, but its new \
value is inside that position, at `{path}`; the position must hold the value itself. Return \
it at a position of its own:

    return {param}, ...

(and unpack the call's result the same way).
"""

STATE_POSITION = """\
`{name}` ({where}): state= says `{param}` comes back at return position {pos}, but the step \
returns {count} ({returns}); positions count from 0. Give the position of its new value among \
them, or return it at a position of its own:

    return {param}, ...
"""

# -- The call: arguments, shapes and structures of one call, and errors raised inside it.

BAD_CALL = """\
Calling `{name}` ({where}): {reason}.

Its signature is `{name}{signature}`.
"""

UNHASHABLE_STATIC = """\
Calling `{name}` ({where}): static argument `{param}` got a value of type {type} that cannot \
be hashed, so it cannot select a compiled version. Pass a hashable value (a tuple instead of a \
list, a frozen dataclass instead of a dict), or pass it as an array-valued argument instead of \
naming it in static_argnames=.
"""

NOT_AN_ARRAY = """\
Calling `{name}` ({where}): `{path}` is a {type}, not an array, and `{param}` is {role}: JAX can \
only pass arrays (and Python numbers) into the compiled step. Make it an array, or pass a \
hashable Python value as static:

    @autoflat.step(..., static_argnames="{param}")
"""

BAD_SCAN_LENGTH = """\
Calling `{name}` ({where}) with num_steps={num_steps}: {reason}.

Per-step inputs (here: {scanned}) carry a leading axis with one entry per step, so for
num_steps={num_steps} stack {num_steps} batches:

    batches = jax.tree.map(lambda *xs: jnp.stack(xs), *[batch_0, ..., batch_{last}])

A final chunk may be shorter than num_steps (it runs that many steps). Arguments that stay the
same for every step of a call belong in broadcast=. State carried from step to step must be
returned by name from every `return` (`params = optax.apply_updates(params, updates)` then
`return params, ...`), not as an expression.
"""

STRUCTURE_CHANGED = """\
`{name}` ({where}) changed the structure of its state `{param}` from one step to the next:
{diff}

With num_steps={num_steps} the steps of one call run in a `lax.scan`, whose carried state must
keep its tree structure, non-array fields, shapes and dtypes from step to step. {advice}
"""

# STRUCTURE_CHANGED's advice: by default; where a Python number in the state changed or came
# in or out where an array was; where
# the new shape holds the leading axis of an argument read as broadcast by its shape
# (`_runtime.tracing`), with the fix for a leading axis longer or shorter than num_steps;
# where state returned by name leads with num_steps (a per-step input returned).
STRUCTURE_FIXED = """\
Keep them fixed, or use num_steps=1, where the structure may change between calls."""

STRUCTURE_SCALAR = """\
Keep them fixed.
A Python number in the state is part of its structure. It goes in as an array where the first
call saw the step change it or saw an array there; this one was not, so pass it as an array
(`jnp.asarray(0)` rather than `0`), and return an array where an array came in; or use
num_steps=1, where the structure may change between calls."""

STRUCTURE_BROADCAST = """\
Keep them fixed.

`{arg}` was read as broadcast, the same value for every step, because its leading axis is \
{axis}, not num_steps={num_steps} [rule: no-leading-axis], and that axis is in the state's new \
shape. {fix} If `{arg}` is one value for every step, keep the state's shapes fixed with it."""

STRUCTURE_BROADCAST_LONGER = """\
If `{arg}` holds one entry per step, pass {num_steps} per call (`{arg}[:{num_steps}]`, the \
rest in later calls), or use num_steps={axis}."""

STRUCTURE_BROADCAST_SHORTER = """\
If `{arg}` is a first chunk of {axis} steps, say so with `per_step="{arg}"`, or pass a first \
chunk of {num_steps} (shorter chunks are fine after it)."""

STRUCTURE_RETURNED_PER_STEP = """\
Keep them fixed, or use num_steps=1, where the structure may change between calls.

`{arg}` is carried as state because the step returns it by name [rule: returned-by-name], \
and every array in it has a leading axis of num_steps={num_steps}: each step saw the whole \
chunk. If `{arg}` is a per-step input whose new value the step returns each step, say so \
(its returned values are then stacked):

    @autoflat.step(..., per_step="{arg}")"""

AOT_MISMATCH = """\
Calling the compiled `{name}` ({where}) with arguments whose structures, static values, \
shardings or roles differ from those it was lowered with. Lower it again for these arguments \
(`{name}.lower(...).compile()`), or call the step itself, which compiles as needed.
"""

USER_ERROR_NOTE = "autoflat: raised in `{name}` at {where} (generated code: autoflat.show({name}))"

NOTHING_TO_RECOVER = """\
`{name}` ({where}): nothing to recover. `recover()` returns the result of a call that a \
KeyboardInterrupt stopped after its compiled program ran; the last call either finished, or \
was stopped before its program ran (then the state you passed in is intact: call the step \
again with it), or the step was called again since.
"""

CONSUMED_BY_INTERRUPTED = """\
Calling `{name}` ({where}): state passed to this call was consumed by call {call}, which a \
KeyboardInterrupt stopped after its compiled program ran. Its results are kept: \
`{name}.recover()` returns them as that call would have (write-backs into your objects \
included); call it, then go on from what it returns.
"""

INTERRUPTED_RECOVERABLE = """\
autoflat: this interrupt came after the compiled program of `{name}` ({where}) ran: the \
state passed to the call may be consumed, and the call's results are kept. \
`{name}.recover()` returns them as the call would have (write-backs into your objects \
included): call it before the step's next call, which forgets them."""

# -- Handles and write-back: donated buffers, state written back into the caller's objects.

CONSUMED = """\
This `{param}` was consumed by call {call} of `{name}` ({where}): its buffers were donated to \
that call, which updated them in place. Use the value that call returned instead:

    {param}, ... = {name}({param}, ...)

If that call was stopped by a KeyboardInterrupt after its program ran, `recover()` on the \
step returns what it would have.

To keep an independent copy before the call, use `copy.deepcopy({param})` (or
`jax.tree.map(jnp.copy, autoflat.unwrap({param}))`), or decorate with
`@autoflat.step(..., donate=False)`.
"""

CONSUMED_LOST = """\
This `{param}` was consumed by call {call} of `{name}` ({where}), which an interrupt stopped \
after its compiled program ran and before its results reached autoflat: its buffers were \
donated to that call, and the results are lost with them. Restart from a checkpoint, or from \
state you kept.
"""

NOT_A_TREE_WRITTEN = """\
`{name}` ({where}) changes its argument `{param}` in place, so autoflat would write the new \
value back into your object, but JAX takes a {type} as one leaf, not as a tree of arrays: \
nothing in it can cross `jax.jit` (`jax.jit` refuses it too). Make {type} a pytree \
(`@jax.tree_util.register_dataclass` on a dataclass, or `jax.tree_util.register_pytree_node`), \
or pass and return the arrays it holds:

    {param} = ...
    return {param}, ...
"""

NOT_RETURNED = """\
`{param}` of `{name}` ({where}) is state (named in state=) but no `return` gives it back by \
name, and its value (a {type}) cannot be updated in place. Return it by name from every \
`return`:

    {param} = ...
    return {param}, ...
"""

LEFT_TRACED = """\
`{name}` ({where}) left a traced value in `{path}`, in your object: JAX takes a {type} as one \
static leaf, not as a tree of arrays, so the step gets your very object, and what the step \
writes into it while it is traced (in its body or in a function it calls) cannot leave \
`jax.jit` (a static argument of `jax.jit` leaks the tracer the same way). autoflat put the \
previous value back. Make {type} a pytree (`@jax.tree_util.register_dataclass` on a \
dataclass, or `jax.tree_util.register_pytree_node`) and return the new value from the step:

    {param} = ...
    return {param}, ...
"""

CANNOT_WRITE_BACK = """\
`{name}` ({where}) mutates its argument `{param}` without returning it, so autoflat writes the \
updated value back into the caller's object, but the part at `{path}` is immutable \
({type}). Return `{param}` from the step instead:

    return {param}, ...
"""

# Lazy handles met by other code. Not about a step (no {name} or {where}): JAX prints the
# first two itself where a handle meets a tree of another type (`repr(LazyHandle)`, and a
# handle's node data in a treedef); the third is a TypeError.
HANDLE_TYPE = (
    "<class 'autoflat.LazyHandle'> (a lazy handle that an autoflat step returned: it does "
    "not pair with real trees in multi-tree operations; pass autoflat.unwrap(x) there, or "
    "decorate the step with lazy=False to get real objects back)"
)

HANDLE_NODE = "autoflat handle of {type} (autoflat.unwrap(x) is the {type}; or lazy=False)"

HANDLE_BUILT_BY_TYPE = """\
autoflat.LazyHandle cannot be made from values: this code rebuilds a value by its type \
(`type(x)(...)`, as flax.serialization.from_state_dict does for a named tuple), and `x` is a \
lazy handle that an autoflat step returned. Pass the real object, `autoflat.unwrap(x)`, or \
decorate the step with `lazy=False` to get real objects back.\
"""

# -- Flax NNX: shared Variables, modules that are not pytrees.

SHARED_VARIABLE = """\
`{name}` ({where}): the same nnx.Variable is reachable as `{first}` and as `{second}`, and \
not every argument reaching it is a Flax NNX object that the step updates in place. autoflat \
moves a returned object (or a container other than an NNX object) across `jax.jit` as a \
pytree, which would split the Variable into two copies that are updated apart.

Shared Variables work between NNX objects that the step mutates and does not return (an
optimizer holding the model's Variables, a submodule stored twice, tied weights), as with
`nnx.jit`: return neither object, or reach each Variable from one argument only.
"""

PER_STEP_BY_SHAPE_NOTE = """\
autoflat read {names} as per-step by the leading axis alone ({num_steps} = num_steps): each \
step saw one slice of {them}. If the error comes from {which} the same for every step (a \
full batch, a table), say so: @autoflat.step(num_steps={num_steps}, broadcast={declared})"""

NNX_SHARED_ANEW = """\
`{name}` ({where}): the step leaves one Flax NNX node reachable as `{first}` and as \
`{second}` (stored twice, as `model.b = model.a` does) in state that came in without it. \
autoflat carries that state across `jax.jit` as a pytree, which would split the node into \
two copies, updated apart from the next call on.

Store it twice before the first call (`model.b = model.a` outside the step): sharing that
the state comes in with is kept, as with `nnx.jit`.
"""

NNX_NESTED = """\
`{param}` of `{name}` ({where}) holds a Flax NNX `{cls}` at `{path}`, inside another value \
({role}). autoflat writes what a step changes in place back into Flax NNX objects \
passed as arguments of their own (as `nnx.jit` does); one inside a tuple, list or dict would \
lose those changes. Pass it as a parameter of its own:

    def train_step(model, optimizer, *batch): ...

or return the value that holds it, so that it is state and comes back changed.
"""

NNX_NOT_PYTREE = """\
`{param}` of `{name}` ({where}) {holds} a Flax NNX `{cls}` declared with `pytree=False`. \
autoflat passes Flax NNX objects across `jax.jit` as pytrees (as Flax's own `nnx.Pytree` \
flattening does), and JAX sees this one as a single opaque value, so its Variables could be \
neither traced nor updated. Declare `{cls}` as a pytree (the default: drop `pytree=False`, \
hold a list of submodules in `nnx.List([...])` and other attributes with `nnx.data(...)` or \
`nnx.static(...)`), or use `nnx.jit` for this step.
"""

# -- Feeding: `autoflat.chunks`, about the batches it is given.
# Not about a step function (no {name} or {where}): filled in with `.format` and raised as
# ShapeError, TypeError or ValueError.

CHUNK_STRUCTURE = """\
autoflat.chunks: batch {index} has a different tree structure from batch 0: {diff}.

Each chunk stacks every leaf of a batch with the same leaf of the other batches, so every
batch must have the containers and keys of the first. Make the input yield one structure, for
example always the same keys of a dict:

    {{"image": image, "label": label}}   # not sometimes {{"image": image}}
"""

CHUNK_LEAF = """\
autoflat.chunks: batch {index}, leaf {path}: {got}, but batch 0 had {first}.

Every batch must keep the shapes and dtypes of the first: a chunk is one array per leaf, and a
step compiled for one shape compiles again for another. Only the final chunk may have fewer
steps than num_steps. Drop or pad a smaller last batch (`drop_remainder=True` in tf.data,
`drop_last=True` in a PyTorch DataLoader, `len(x) // batch_size` full batches for NumPy), and
cast every batch to one dtype.
"""

CHUNK_LEAF_TYPE = """\
autoflat.chunks: batch {index}, leaf {path} is {what}, which cannot be stacked into an array.

Every leaf of a batch must be an array (NumPy or JAX) or a Python number. Keep other values
(names, file paths, metadata) out of the batches given to chunks.
"""

CHUNK_SHARDING = """\
autoflat.chunks: cannot place a chunk with {sharding}: {reason}.

Pass the sharding of one step's batch as a NamedSharding, for example
`NamedSharding(mesh, P("data"))` to split the batch axis over the mesh axis "data"; chunks
places each chunk with `P(None, "data")`, the per-step axis unsharded.
"""

CHUNK_SHARDING_TREE = """\
autoflat.chunks: sharding= must be one Sharding for every leaf, or a pytree of Shardings that
is a prefix of the batch's structure; {reason}.
"""
