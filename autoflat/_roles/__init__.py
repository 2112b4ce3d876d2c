"""Roles: every parameter becomes state, per-step, broadcast or static.

Owns the role rules (`rules`: one ordered table, the table of docs/roles.md, each rule a named
function giving a role with its evidence or passing), the options and the roles they give
(`options`, `roles`), the first call's inference (`infer`: what the rules read from the
first call's values), the abstract evaluation of one step and comparison of abstract values
(`abstract`), one step's data flow read off its jaxpr (`flow`), state matched by abstract
value (`matching`), what a name in the source stands for at the first call (`lookup`: an
optimizer, optax's or not), what a returned name says of a parameter (`names`: the word rules), the
tuples written in a `return` that a call looks into (`nesting`), readings autoflat refuses
to choose between (`hazards`: leading axes and per-step arguments; `state_hazards`:
returned state; `checks`: the order the first call checks them in once state is matched)
and Python numbers at the first call (`scalars`).

Takes in: the `Analysis`, the options, and (at the first call) the arguments.
Hands on: `Roles` (each parameter's role, its evidence and the rule that decided it, each
return position's meaning) to code generation and the runtime.
"""
