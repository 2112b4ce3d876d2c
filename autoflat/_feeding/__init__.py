"""Feeding: per-step batches stacked into chunks of `num_steps` for a step.

Owns `autoflat.chunks` (`chunks`: the iterator, its prefetch thread and `close()`) and the
stacking and placing of each chunk (`stacking`).

Takes in: any iterable of per-step batches. Hands on: stacked per-step inputs, for the user to
pass to a step. Independent of the other stages (it imports only the shared errors).
"""
