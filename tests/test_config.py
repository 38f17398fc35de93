"""SpeculationConfig: one typed description of what speculates, built from every surface and
validated in one place (specdec/config.py)."""

import argparse
import dataclasses

import pytest

from specdec.config import SpeculationConfig
from specdec.names import AUTO_GAMMA, GAMMA, NO_DRAFTER, THRESHOLD_GAMMA, TREE_BUDGET


def test_what_runs_when_unset():
    assert SpeculationConfig().chosen_policy == "auto" and SpeculationConfig().chosen_gamma == AUTO_GAMMA
    assert SpeculationConfig(drafter="ngram").chosen_policy == "fixed"
    assert SpeculationConfig(drafter="ngram").chosen_gamma == GAMMA
    assert SpeculationConfig(drafter="ngram", tree=True).chosen_policy == "tree-cost"
    assert SpeculationConfig(drafter="ngram+suffix").trees and SpeculationConfig(drafter="ngram-tree").trees
    assert SpeculationConfig(drafter="staged", policy="threshold").chosen_gamma == THRESHOLD_GAMMA
    assert SpeculationConfig(drafter="ngram-tree").nodes == TREE_BUDGET
    assert not SpeculationConfig(drafter=NO_DRAFTER).drafts


def test_it_is_frozen_and_a_changed_copy_is_checked_again():
    config = SpeculationConfig(drafter="ngram")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gamma = 3  # type: ignore[misc]
    assert config.with_options(gamma=3).chosen_gamma == 3
    with pytest.raises(ValueError, match="--tree-budget does not apply"):
        config.with_options(tree_budget=8)


@pytest.mark.parametrize("options, message", [
    (dict(drafter="auto", policy="heuristic"), "--policy heuristic does not apply to --drafter auto"),
    (dict(drafter="suffix", policy="auto"), "--policy auto is the auto drafter's own"),
    (dict(drafter="auto", tree=True), "--tree does not apply to --drafter auto"),
    (dict(drafter="model", tree_budget=4), "--tree-budget does not apply"),
    (dict(drafter="ngram", draft_head="DIR"), "--draft-head does not apply"),
    (dict(drafter="ngram", index=("default",)), "--index does not apply"),
    (dict(drafter="ngram", speculation="auto", policy="cost"), "--policy does not apply to a server"),
    (dict(speculation="sometimes"), "unknown --speculation"),
    (dict(drafter="nope"), "unknown --drafter 'nope'"),
    (dict(drafter="ngram", vocab_rule="maybe"), "unknown --vocab-rule"),
    (dict(drafter="ngram", policy="best"), "unknown --policy"),
    (dict(drafter=NO_DRAFTER, gamma=2, given=frozenset({"gamma"})), "--gamma does not apply without a drafter"),
    (dict(gamma=-1), "--gamma must be >= 0"),
])
def test_a_combination_that_does_not_apply_names_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculationConfig(**options)


def test_tree_applies_to_merges_and_suffix_first_specs():
    assert SpeculationConfig(drafter="ngram+model", tree=True).trees
    assert SpeculationConfig(drafter="suffix-or-ngram", tree=True, tree_budget=8).nodes == 8


def parsed(*argv: str) -> SpeculationConfig:
    from specdec.commands.cli import build_parser

    args = build_parser().parse_args(list(argv))
    args.argv = list(argv)
    return SpeculationConfig.from_args(args)


def test_from_the_command_line():
    assert parsed("generate", "x").drafter == "auto"
    assert parsed("generate", "x", "--tree").drafter == "ngram"
    assert parsed("generate", "x", "--no-draft").drafter == NO_DRAFTER
    assert parsed("generate", "x", "--drafter", "none") == parsed("generate", "x", "--no-draft")
    assert parsed("serve", "--speculation", "off").speculation == "off"
    assert parsed("bench-serve", "--modes", "on", "off").speculation == "on"
    assert parsed("generate", "x", "--drafter", "ngram", "--ngram-max", "3").ngram_max == 3
    config = parsed("generate", "x", "--drafter", "ngram-tree", "--tree-budget", "6", "--gamma", "5")
    assert (config.chosen_policy, config.chosen_gamma, config.nodes) == ("tree-cost", 5, 6)


def test_from_a_bench_method_name():
    config, flags = SpeculationConfig.from_method("suffix:cost@unforced@lossy")
    assert (config.drafter, config.policy, config.draft_forced, flags) == ("suffix", "cost", False, [])
    assert config.acceptance != "exact"
    assert SpeculationConfig.from_method("auto@noindex")[0].chosen_policy == "auto"
    with pytest.raises(ValueError, match="does not apply to --drafter auto"):
        SpeculationConfig.from_method("auto:cost")


def test_the_python_api_builds_the_decoder_a_config_describes(tiny_pair):
    from specdec import SpeculativeDecoder, load

    target = load(tiny_pair["target"], dtype="float64")
    decoder = SpeculativeDecoder.from_config(target, SpeculationConfig(drafter="ngram", policy="cost", gamma=3))
    policy = decoder.engine.new_policy()
    assert policy.name == "cost" and policy.costs is decoder.engine.costs  # one cost model
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    assert decoder.generate(prompt, max_new_tokens=10).token_ids == \
        SpeculativeDecoder.from_config(target, SpeculationConfig(drafter=NO_DRAFTER)).generate(
            prompt, max_new_tokens=10).token_ids
    auto = SpeculativeDecoder.from_config(target, SpeculationConfig())
    assert auto.engine.costs is auto.drafter.costs


def test_unset_namespace_fields_keep_the_defaults():
    config = SpeculationConfig.from_args(argparse.Namespace(drafter="ngram"))
    assert config == SpeculationConfig(drafter="ngram")
