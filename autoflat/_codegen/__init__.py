"""Code generation and loading: the step's flattened, k-step source, made live.

Owns the generated source as a value (`generate`: libcst templates around the user's body,
every `return` rewritten) and its loading (`loading`: compiled under a descriptive file name,
registered with `linecache`, bound to the user's globals and closure cells, errors in it
mapped back to the user's lines).

Takes in: the `Analysis` and the `Roles`.
Hands on: `GeneratedCode` and the loaded function, to the runtime's programs.
"""
