"""The call runtime: a call of a decorated step, from its arguments to its results.

Owns programs (`program`), call specs and the spec cache (`specs`), a first call's trial trace
that serves its roles' abstract evaluation (`trial`), a method instance's part of a spec's key
(`instance`), the helpers generated code calls inside the trace (`tracing`), the traced entry
and the `jax.jit`s (`entry`), the call path before the launch (`call`: bind, take in state;
`returned`: a `lazy=False` object coming back) and after it (`finish`), the launch itself
(`launch`: donation, interrupts, errors pointed at the user's code), the ahead-of-time stages
(`stages`), the counters and recompile warning (`diagnostics`) and `autoflat.profile`
(`profile`).

Takes in: a step's `Analysis`, options and a call's arguments.
Hands on: results (handles for state, stacked per-step outputs) to the facade (`_step.Step`).
"""
