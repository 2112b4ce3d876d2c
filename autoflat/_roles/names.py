"""What the names a step gives back say: the word rules that matching and the checks read.

A name at a return position is weak evidence, asked only where the step's data flow leaves a
reading open. Every rule splits names into words (`split_name`: snake and camel case, digits
dropped) and reads them against the parameter's, from the strictest to the loosest:

- `renamed`: the parameter's own name, or it with a word for new (`ema`, `new_ema`, `ema2`);
- `named_for`: `renamed`, or the parameter's name less a word for previous (`loss` for
  `prev_loss`);
- `named_within`: a name holding the parameter's head word (`new_weights` for
  `expert_weights`, `new_lr` for `lr_state`; not `loss` for `loss_weights`);
- `named_after`: a name sharing a word with it (`ema_params` for `ema`);
- `named_as_gradients`: `named_after`, for gradients given back, unless only the name says
  gradients (`params_grads` for `teacher_params`);
- `may_name`: `named_after`, words for new only (`updated`), or a word beside one that begins
  the parameter's name (`p_next` for `params`);
- `extreme_named` (aside): a shared word for a running extreme (`new_best` for `best_loss`).

Each takes `(p, pos, names)`: the parameter, a return position and the names a `return`
gives back (None for an expression), and is False at an expression.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

Names = tuple[str | None, ...]
NameRule = Callable[[str, int, Names], bool]


def name_at(names: Names, pos: int) -> str | None:
    """The name a `return` gives back at position `pos`, or None (an expression, or no such
    position)."""
    return names[pos] if pos < len(names) else None


def _at_position(rule: Callable[[str, str], bool]) -> NameRule:
    """`rule(p, name)` asked of the name at a return position; False at an expression."""

    @functools.wraps(rule)
    def at(p: str, pos: int, names: Names) -> bool:
        name = name_at(names, pos)
        return name is not None and rule(p, name)

    return at


def _renamed(p: str, name: str) -> bool:
    words = [w for w in split_name(name) if w not in _NEW]
    own = split_name(p)
    return words == own or (len(words) == 1 and words[0] == "".join(own))  # (`vhat`, `v_hat`)


@_at_position
def renamed(p: str, name: str) -> bool:
    """Whether the name is `p`'s own, or it with a word for new (`new_ema`, `ema_next`,
    `ema2` for `ema`): stricter than `named_after`, where a shared word alone (`loss` for
    `loss_weight`, `distill_loss` for `distill_weight`) says nothing."""
    return _renamed(p, name)


@_at_position
def named_for(p: str, name: str) -> bool:
    """Whether the name is `p`'s name for its new value (`renamed`: `v`, `new_v`, `v2`) or
    `p`'s name without a word for previous (`loss` for `prev_loss`, `g` for `last_g`):
    stricter than `named_after`, where a shared word alone (`kl` for `kl_weight`, `loss` for
    `loss_scale` or `best_loss`) says nothing."""
    if _renamed(p, name):
        return True
    words = split_name(p)
    kept = [w for w in words if w not in _OLD]
    return len(kept) < len(words) and kept == [w for w in split_name(name) if w not in _NEW]


def _named_after(p: str, name: str) -> bool:
    return bool(words(name) & words(p))


@_at_position
def named_after(p: str, name: str) -> bool:
    """Whether the name shares a word with `p` (`new_v`, `v2`, `loss` for `prev_loss`): the
    step's own words for `p`'s new value."""
    return _named_after(p, name)


@_at_position
def named_as_gradients(p: str, name: str) -> bool:
    """For gradients given back: whether the name shares a word with `p` and says gradients
    only if `p`'s name does (`g` for `prev_g`, `grads` for `last_grads`; not `params_grads`
    for `teacher_params`, the new gradients beside a teacher's parameters)."""
    return _named_after(p, name) and (names_gradients(p) or not names_gradients(name))


@_at_position
def may_name(p: str, name: str) -> bool:
    """Whether the name may say it holds `p`'s new value: one sharing a word with it
    (`named_after`: `v2`, `new_v`, `newV`), one of words for new only (`updated`, `new`), or
    one word beside a word for new that begins `p`'s first word (`p_next` for `params`,
    `new_w` for `weights`; not `x` alone for `xs`, a batch logged). Looser than
    `named_after`: it only makes a reading worth asking about."""
    if _named_after(p, name):
        return True
    split = split_name(name)
    kept = [w for w in split if w not in _NEW]
    own = split_name(p)
    if not kept:
        return bool(split)
    return len(kept) == 1 < len(split) and bool(own) and own[0].startswith(kept[0])


@_at_position
def named_within(p: str, name: str) -> bool:
    """Whether the name, less words for new, holds `p`'s head word (`weights` or
    `new_weights` for `expert_weights`, `new_lr` for `lr_dict` or `lr_state`, `sched_state`
    for `lr_state`; not `loss` for `loss_weights`, a word that only says what the weights
    are of, nor `clip_stats` for `clip_bounds`): stricter than `named_after`, where any
    shared word (`loss_parts` for `loss_weights`) counts."""
    kept = {w for w in split_name(name) if w not in _NEW}
    return bool(kept & _heads([w for w in split_name(p) if w not in _NEW]))


def _heads(words: list[str]) -> set[str]:
    """A name's head words: its last, and its last other than a word for a container or
    for state (`weights` in `loss_weights`; `state` and `lr` in `lr_state`, `lr` in
    `lr_dict`)."""
    kept = [w for w in words if w not in _GENERIC_WORDS]
    return set(words[-1:]) | set(kept[-1:])


@_at_position
def extreme_named(p: str, name: str) -> bool:
    """Whether the name shares with `p` a word for a running extreme (`new_best` for
    `best_loss`, `running_max` for `max_gnorm`, `cur_min` for `min_val`): a clamp's bound and
    the clamped value share none (`loss` for `loss_floor`)."""
    return bool(words(name) & words(p) & _EXTREME_WORDS)


def names_gradients(p: str) -> bool:
    """Whether the parameter's name says it holds gradients (`prev_grads`, `last_g`)."""
    return bool(words(p) & {"g", "grad", "grads", "gradient", "gradients"})


_NEW = frozenset({"new", "next", "updated", "upd"})
_GENERIC_WORDS = frozenset({"dict", "tuple", "list", "tree", "map", "pytree", "state", "states"})
_OLD = frozenset({"prev", "previous", "last", "old", "past"})
_EXTREME_WORDS = frozenset(
    {"best", "worst", "max", "min", "amax", "amin", "peak", "highest", "lowest", "record"}
)


def words(name: str) -> set[str]:
    """`new_ema_params` -> {new, ema, params}; `v2` -> {v}; `newP` -> {new, p}."""
    return set(split_name(name))


def split_name(name: str) -> list[str]:
    """A name's words, lower case, digits dropped: `new_ema_params` -> [new, ema, params],
    `v2` -> [v], camel case too: `newP` -> [new, p], `emaNew` -> [ema, new], `LR` -> [lr]."""
    return [w.lower() for w in _WORD.findall(name)]


_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def tokens(name: str) -> set[str]:
    """A name's words with their digits, lower case: `new_q1` -> {new, q1}, `criticParams2`
    -> {critic, params2}; what tells twins apart (`matching.settle_alike`)."""
    return {w.lower() for w in _TOKEN.findall(name)}


_TOKEN = re.compile(r"[A-Z]+(?![a-z])\d*|[A-Z]?[a-z]+\d*|\d+")
