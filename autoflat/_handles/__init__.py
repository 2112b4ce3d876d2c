"""Handles and frameworks: the state objects the user holds between calls.

Owns lazy handles (`lazy`: a returned state value standing for the real object until it is
used), mutation-style state written back into the caller's objects (`writeback`), Flax NNX
objects as state called again and again (`nnx`), and the identity snapshot of an object graph
that the NNX fast path checks (`snapshot`).

Takes in: structures and leaves from the transport stage; the user's objects.
Hands on: `LazyHandle`, `new_handle`, `write_back`, `NnxState`, to the roles (which recognise
handles and mutable modules among a call's arguments) and the runtime.
"""
