"""Source analysis: what a step function's own source says, read with libcst.

Owns finding the function's source (`source`: unwrapping `jax.jit` / `eqx.filter_jit`
wrappers, reading and dedenting the text), the one libcst pass over it (`visitor`), which
names of the function's own scope hold only gradients, from the assignments that pass
collected (`gradients`), the frozen `Analysis` value built from that pass (`analysis`), and
each `return` as a value with the tuples written in it that are looked into (`returns`).

Takes in: the user's function, at decoration.
Hands on: `Analysis` (parameters, every `return` and the names it returns, the parameters the
body writes into or calls methods on, the names read from outside, the line offset back to the
user's file), to the roles, code generation and the runtime. Imports no other stage.
"""
