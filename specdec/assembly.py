"""The one place an engine is assembled: ``build_engine(target, config, ...)``.

Every surface speculates through it: the Python API (``SpeculativeDecoder``, by names or with a
drafter object), ``specdec generate`` and ``explain``, bench's methods and the server. It owns what
must be decided once: the cost model the drafter, the policy and the engine share; the draft head
found for the target (where the config lets one draft and none is given); the drafter the config
names; the draft-length policy (``SpeculationConfig.chosen_policy``, ``chosen_gamma``); whether a
grammar's forced tokens are drafted. The engine itself decides none of it.

A drafter object given by the caller (``drafter=``: a Drafter, or a draft LanguageModel) takes the
place of the one the config names; ``SpeculationConfig.of_drafter`` describes such an object, so
its policy and gamma are chosen by the same rule as a named drafter's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from specdec.config import PolicyName, SpeculationConfig
from specdec.core.drafts import Drafter
from specdec.core.engine import Engine, decision_costs
from specdec.core.estimates import CostModel
from specdec.core.policy import DraftLengthPolicy
from specdec.core.request import VerifyHook
from specdec.models.base import LanguageModel
from specdec.names import NO_DRAFTER

NAMED = object()  # build_engine's ``drafter`` unset: the config's named drafter is made here


def build_engine(
    target: LanguageModel,
    config: SpeculationConfig,
    *,
    drafter: Any = NAMED,
    policy: DraftLengthPolicy | None = None,
    draft: LanguageModel | None = None,
    head: Any = None,
    corpus: Sequence[Any] = (),
    drafter_options: dict[str, Any] | None = None,
    costs: CostModel | None = None,
    prefill_chunk: int | None = None,
    max_context: int | None = None,
    requests_choose_lengths: bool = True,
    verify_hook: VerifyHook | None = None,
    say: Callable[[str], None] | None = None,
) -> Engine:
    """The engine ``config`` describes on loaded models.

    ``drafter``: unset, the config's drafter is made here (``draft``: a draft model for the
    drafters that take one; ``head``: a DraftHead or folder, else the config's draft_head, else the
    head found for the target where one may draft; ``corpus``: datastores; ``drafter_options``:
    keywords of make_drafter, e.g. ``suffix_cache_tokens=0``); given (a Drafter, a draft
    LanguageModel, or None for the target alone), it is used as it is. ``policy``: a policy object
    in place of the config's (engine_of puts its name in the config, which checks it). ``costs``: the one cost
    model (None: the drafter's or the policy's own, else a fresh one). ``requests_choose_lengths``:
    False for a server, whose controller chooses every step's draft lengths (no request gets a
    policy). ``say``: told, in one line, of a head found for the target."""
    from specdec.drafting import as_drafter

    if drafter is NAMED:
        costs = costs if costs is not None else getattr(policy, "costs", None) or CostModel()
        made: Drafter | None = config.make_drafter(target, draft, find_head_once(target, config, head, say),
                                                   corpus, costs, **(drafter_options or {}))
    else:
        made = as_drafter(drafter, target)
    costs = decision_costs(costs, made, policy)
    template = None
    if made is not None and requests_choose_lengths:
        template = policy if policy is not None else config.make_policy(costs)
    return Engine(target, made, template, config.draft_forced, prefill_chunk, max_context, verify_hook, costs)


def find_head_once(target: LanguageModel, config: SpeculationConfig, head: Any,
                   say: Callable[[str], None] | None = None) -> Any:
    """The head a drafter of ``config`` drafts with: ``head``, else the config's draft_head, else,
    where the config lets a head draft, the one found for the target (said through ``say``)."""
    if head is None:
        head = config.draft_head
    if head is None and config.reads_head:
        from specdec.drafting.head_finder import find_head

        head = find_head(target)
        if head is not None and say is not None:
            say(f"draft head found for this target: {head}")
    return head


def engine_of(target: LanguageModel, drafter: Drafter | LanguageModel | str | None = None, gamma: int | None = None,
              policy: str | DraftLengthPolicy | None = None, draft_forced: bool = True, **options: Any) -> Engine:
    """An engine from parts, as the Python API hands them over: ``drafter`` a Drafter object, a draft
    model, a drafter's name (made on the target: "auto", "suffix", ...) or None; ``policy`` a name
    or a policy object; ``options``: build_engine's keywords (prefill_chunk, costs, ...)."""
    policy_name = policy if isinstance(policy, str) or policy is None else policy.name
    policy_object = None if isinstance(policy, str) else policy
    if drafter is None:  # the target alone: a draft length or policy has nothing to apply to
        return build_engine(target, SpeculationConfig(drafter=NO_DRAFTER, draft_forced=draft_forced), **options)
    if isinstance(drafter, str):
        config = SpeculationConfig(drafter=drafter, gamma=gamma, policy=cast(PolicyName | None, policy_name),
                                   draft_forced=draft_forced)
        return build_engine(target, config, policy=policy_object, **options)
    config = SpeculationConfig.of_drafter(drafter, gamma, policy_name, draft_forced)
    return build_engine(target, config, drafter=drafter, policy=policy_object, **options)
