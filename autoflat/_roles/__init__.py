"""Stage 4, roles: every parameter becomes state, per-step, broadcast or static.

Owns the role rules (the ordered table that docs/roles.md mirrors), the first call's
inference (`infer`: run-time types and shapes), the abstract evaluation of one step and
comparison of abstract values (`abstract`), state matched by abstract value (`matching`),
readings autoflat refuses to choose between (`hazards`) and Python numbers at the first call
(`scalars`).

Takes in: the `Analysis`, the options, and (at the first call) the arguments.
Hands on: `Roles` (each parameter's role and evidence, each return position's meaning) to
code generation and the runtime.
"""
