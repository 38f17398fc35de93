"""The one assembly (specdec/assembly.py): every surface that can describe speculation (the command
line, bench's method names, the Python API) builds its SpeculationConfig the same way and gets the
same engine from build_engine, or the same one-line refusal naming the option."""

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import names
from specdec.assembly import build_engine, engine_of
from specdec.commands.cli import build_parser, check_arguments
from specdec.config import PolicyName, SpeculationConfig, SpeculationMode, VocabRule
from specdec.core.drafts import describe_drafter

# Drafters a tiny target drafts with by itself, or with its draft model; heads and datastores apart
# (a tiny target has no head to find, no index: refused alike on every surface, checked below).
KINDS = ["auto", "ngram", "suffix", "staged", "model", "tree", "ngram-tree", "suffix-or-ngram", "ngram+suffix",
         "none", "nonsense"]
POLICIES = [None, *names.POLICIES, *names.TREE_POLICIES]


def test_the_typed_fields_hold_exactly_the_names_values():
    assert set(typing.get_args(PolicyName)) == set(names.POLICIES + names.TREE_POLICIES)
    assert set(typing.get_args(VocabRule)) == set(names.VOCAB_RULES)
    assert set(typing.get_args(SpeculationMode)) == set(names.SPECULATION_MODES)


def from_command_line(kind: str, policy: str | None, gamma: int | None) -> SpeculationConfig:
    argv = ["generate", "x", "--drafter", kind, *(["--policy", policy] if policy else []),
            *(["--gamma", str(gamma)] if gamma is not None else [])]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # argparse's own refusal (an unknown --policy choice): the message it printed
        raise ValueError(f"--policy {policy!r} refused by the parser") from None
    args.argv = argv
    check_arguments(args)
    return args.speculation_config


def from_method_name(kind: str, policy: str | None, gamma: int | None) -> SpeculationConfig:
    config, flags = SpeculationConfig.from_method(f"{kind}:{policy}" if policy else kind)
    assert flags == []
    # bench's --gamma is the run's, given to every method that drafts (as suite.make_method does)
    return dataclasses.replace(config, gamma=gamma) if config.drafts else config


def from_python(kind: str, policy: str | None, gamma: int | None) -> SpeculationConfig:
    return SpeculationConfig(drafter=kind, policy=policy, gamma=gamma)


def outcome(build, *arguments):
    try:
        return build(*arguments)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and "--" in message, message  # one line, naming the option
        return "refused"


def engine_summary(engine) -> tuple:
    policy = engine.policy
    return (type(engine.drafter).__name__, describe_drafter(engine.drafter), getattr(policy, "name", None),
            getattr(policy, "gamma", None), getattr(policy, "max_gamma", None), engine.draft_forced)


@pytest.fixture(scope="module")
def models(tiny_pair):
    from specdec import load

    return load(tiny_pair["target"], dtype="float64"), load(tiny_pair["perturbed"], dtype="float64")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), policy=st.sampled_from(POLICIES),
       gamma=st.one_of(st.none(), st.integers(min_value=0, max_value=9)))
def test_every_surface_builds_the_same_engine_or_the_same_refusal(models, kind, policy, gamma):
    target, draft = models
    configs = [outcome(build, kind, policy, gamma) for build in (from_command_line, from_method_name, from_python)]
    if kind == "none" and gamma is not None:  # bench's --gamma is the run's: the target alone ignores it
        configs[1] = configs[2]
    if "refused" in configs:
        assert configs == ["refused"] * 3, (kind, policy, gamma, configs)
        return
    assert configs[0] == configs[1] == configs[2], (kind, policy, gamma)
    engines = [engine_summary(build_engine(target, config, draft=draft)) for config in configs]
    assert engines[0] == engines[1] == engines[2]
    config = configs[0]
    engine = build_engine(target, config, draft=draft)
    assert (engine.drafter is None) == (not config.drafts)
    if engine.drafter is not None:  # the policy the config chose, at the gamma it chose
        assert engine.policy.name == config.chosen_policy
        assert getattr(engine.policy, "gamma", getattr(engine.policy, "max_gamma", None)) == config.chosen_gamma


def test_a_drafter_object_and_its_name_build_the_same_engine(models):
    from specdec.drafting import make_drafter

    target, draft = models
    by_name = engine_of(target, "ngram", gamma=3, policy="cost")
    by_object = engine_of(target, make_drafter("ngram"), gamma=3, policy="cost")
    assert engine_summary(by_name)[2:] == engine_summary(by_object)[2:]
    by_model = engine_of(target, draft, gamma=2)
    assert type(by_model.drafter).__name__ == "ModelDrafter" and by_model.policy.name == "fixed"
    auto = make_drafter("auto", target=target)
    assert engine_of(target, auto).policy.name == "auto"  # the auto drafter's own, as by name
    with pytest.raises(ValueError, match="does not apply to --drafter auto"):
        engine_of(target, auto, policy="cost")
    assert engine_of(target, None, gamma=4).drafter is None  # the target alone: no length to apply


def test_the_engine_decides_nothing_the_builder_has_not(models):
    """The engine takes its policy; a server's (requests_choose_lengths=False) has none."""
    target, _ = models
    config = SpeculationConfig(drafter="ngram", policy="threshold", gamma=5)
    assert build_engine(target, config).policy.name == "threshold"
    assert build_engine(target, config, requests_choose_lengths=False).policy is None


def test_no_forced_tokens_and_acceptance_are_carried_by_the_config():
    args = build_parser().parse_args(["generate", "x", "--no-forced-tokens", "--acceptance", "lossy"])
    args.argv = ["generate", "x", "--no-forced-tokens", "--acceptance", "lossy"]
    check_arguments(args)
    config = args.speculation_config
    assert config.draft_forced is False and config.acceptance != "exact"
    from specdec.commands.options import sampling_from_args

    assert sampling_from_args(args).acceptance == config.acceptance
