"""Real training steps copied verbatim from public upstream examples (issue 12).

Each module names its upstream repository, file and commit at the top, says what was shrunk
(model sizes, data), and keeps the step's body exactly as upstream wrote it, undecorated: the
test applies upstream's own jit and `autoflat.step` to the same function. The part after the
line `# ---- corpus harness (not upstream)` is ours: synthetic data, the start state, and
upstream's loop with the decorator and the batching (one batch per call, or `chunk` batches
stacked along a new leading axis) as parameters. `tests/test_corpus.py` runs them.
"""
