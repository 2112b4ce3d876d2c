"""Transport: how state leaves cross the `jax.jit` boundary.

Owns structures (`structure`: the interned static part of a value, flatten and unflatten),
layouts (`layout`: one buffer per leaf, or small leaves packed into a few 1-D buffers per
dtype, and `pack=`'s choice between them), their packing of concrete arrays outside a step
(`host`: a call's state before its launch, a handle's buffers when it is rebuilt), and the
evaluation of a traced step on packed
buffers as wholes (`wholes`, the lazy segments of a buffer; `segments`, the jaxpr
evaluation that runs elementwise updates once on a whole buffer and cuts out the rest).

Takes in: the state values of a call, and (for `segments`) the step's jaxpr.
Hands on: `Structure`, `FlatState`, `Layout` and the packed / unpacked leaves, to handles, roles
and the runtime. Imports only the analysis stage's values and the shared modules.
"""
