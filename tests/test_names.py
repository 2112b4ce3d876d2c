"""The word rules of returned names (`autoflat._roles.names`): each rule on the names its
docstring gives, both ways, and False at an expression."""

import pytest

from autoflat._roles import names

# (rule, parameter, returned name, expected)
CASES = [
    (names.renamed, "ema", "ema", True),
    (names.renamed, "ema", "new_ema", True),
    (names.renamed, "ema", "ema_next", True),
    (names.renamed, "ema", "ema2", True),
    (names.renamed, "v_hat", "vhat", True),
    (names.renamed, "params", "newParams", True),
    (names.renamed, "loss_weight", "loss", False),
    (names.renamed, "distill_weight", "distill_loss", False),
    (names.named_for, "prev_loss", "loss", True),
    (names.named_for, "last_g", "g", True),
    (names.named_for, "v", "new_v", True),
    (names.named_for, "kl_weight", "kl", False),
    (names.named_for, "best_loss", "loss", False),
    (names.named_within, "expert_weights", "new_weights", True),
    (names.named_within, "expert_weights", "weights", True),
    (names.named_within, "lr_dict", "new_lr", True),
    (names.named_within, "loss_weights", "loss_parts", False),
    (names.named_within, "lossWeights", "lossParts", False),
    (names.named_within, "weights", "new", False),
    (names.named_within, "loss_weights", "loss", False),
    (names.named_within, "clip_bounds", "new_bounds", True),
    (names.named_within, "clip_bounds", "clip_stats", False),
    (names.named_within, "prev_g", "g", True),
    (names.named_within, "running_prod", "prod", True),
    (names.named_within, "lr_state", "new_lr", True),
    (names.named_within, "lr_state", "sched_state", True),
    (names.named_within, "state", "plateau_state", True),
    (names.named_within, "kl_state", "kl_stats", True),
    (names.named_within, "h_next", "h_next", True),
    (names.named_within, "clip_bounds", "new_clip", False),
    (names.named_after, "prev_loss", "loss", True),
    (names.named_after, "kl_weight", "kl", True),
    (names.named_after, "v", "new_v", True),
    (names.named_after, "params", "p_next", False),
    (names.may_name, "params", "p_next", True),
    (names.may_name, "weights", "new_w", True),
    (names.may_name, "env_state", "updated", True),
    (names.may_name, "params", "newP", True),
    (names.may_name, "xs", "x", False),
    (names.may_name, "images", "im", False),
    (names.may_name, "params", "loss", False),
    (names.named_as_gradients, "prev_g", "g", True),
    (names.named_as_gradients, "last_grads", "grads", True),
    (names.named_as_gradients, "teacher_params", "params_grads", False),
    (names.named_as_gradients, "teacher_params", "new_params", True),
    (names.extreme_named, "best_loss", "new_best", True),
    (names.extreme_named, "max_gnorm", "running_max", True),
    (names.extreme_named, "min_val", "cur_min", True),
    (names.extreme_named, "loss_floor", "loss", False),
]


@pytest.mark.parametrize(("rule", "p", "name", "expected"), CASES)
def test_rule_on_a_name(rule, p, name, expected):
    assert rule(p, 0, (name,)) is expected


@pytest.mark.parametrize(
    "rule",
    [
        names.renamed,
        names.named_for,
        names.named_within,
        names.named_after,
        names.may_name,
        names.named_as_gradients,
        names.extreme_named,
    ],
)
def test_no_rule_holds_at_an_expression_or_past_the_returns(rule):
    assert rule("ema", 0, (None,)) is False
    assert rule("ema", 1, ("ema",)) is False


def test_words_split_snake_and_camel_case_and_drop_digits():
    assert names.split_name("new_ema_params") == ["new", "ema", "params"]
    assert names.split_name("emaNew") == ["ema", "new"]
    assert names.split_name("LR") == ["lr"]
    assert names.split_name("v2") == ["v"]
    assert names.tokens("new_q1") == {"new", "q1"}
    assert names.tokens("criticParams2") == {"critic", "params2"}


def test_names_that_say_gradients():
    assert names.names_gradients("prev_grads")
    assert names.names_gradients("last_g")
    assert not names.names_gradients("params")
