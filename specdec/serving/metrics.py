"""Prometheus metrics of a server, with vLLM's names where vLLM has one (prefix ``specdec:``).

Each server has its own registry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.core.drafts import StepOutcome
from specdec.drafting.prediction import PREDICTION

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0)


class ServerMetrics:
    """``suffix_caches``: the drafter's cross-request caches (SuffixCache), whose size is reported."""

    def __init__(self, suffix_caches: Sequence[Any] = ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("specdec:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests waiting for a cache row", registry=r)
        self.batch_size = Histogram("specdec:batch_size", "Requests per engine step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.draft_length = Gauge("specdec:spec_decode_draft_length", "Mean draft length chosen for the last step",
                                  registry=r)
        self.drafts = Counter("specdec:spec_decode_num_drafts", "Request-steps that drafted", registry=r)
        self.draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.accepted_tokens = Counter("specdec:spec_decode_num_accepted_tokens", "Accepted draft tokens",
                                       registry=r)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position", ["position"], registry=r)
        self.acceptance_rate = Gauge("specdec:spec_decode_draft_acceptance_rate",
                                     "Accepted / drafted tokens since start", registry=r)
        self.mean_acceptance_length = Gauge("specdec:spec_decode_mean_acceptance_length",
                                            "Tokens emitted per drafting step (accepted + 1) since start", registry=r)
        self.relaxed_accepted = Counter("specdec:spec_decode_num_relaxed_accepted_tokens",
                                        "Accepted draft tokens that the exact test rejected and a LOSSY acceptance "
                                        "rule kept (requests with acceptance other than exact; docs/acceptance.md)",
                                        registry=r)
        self.accepted_from_cache = Counter("specdec:spec_decode_num_accepted_tokens_from_cache",
                                           "Accepted draft tokens copied from earlier requests' outputs", registry=r)
        self.drafter_steps = Counter("specdec:drafter_steps", "Request-steps by the candidate the auto drafter chose "
                                     "(none: no draft)", ["drafter"], registry=r)
        self.drafter_accepted = Counter("specdec:drafter_accepted_tokens", "Accepted draft tokens by the auto "
                                        "drafter's candidate that drafted them", ["drafter"], registry=r)
        self.prediction_tokens = Counter("specdec:prediction_tokens", "Tokens drafted from requests' predictions "
                                         "(OpenAI's predicted outputs), accepted or rejected", ["outcome"], registry=r)
        self.forced_tokens = Counter("specdec:forced_tokens", "Tokens a request's grammar forced, drafted for free "
                                     "(not in the drafted / accepted counts)", registry=r)
        if suffix_caches:
            caches = list(suffix_caches)
            Gauge("specdec:suffix_cache_tokens", "Tokens held in the cross-request suffix cache(s)",
                  registry=r).set_function(lambda: sum(cache.size_tokens for cache in caches))
            Gauge("specdec:suffix_cache_max_tokens", "The cross-request suffix cache's cap (0: off)",
                  registry=r).set_function(lambda: sum(cache.max_tokens for cache in caches))
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens prefilled (computed)", registry=r)
        self.forked_prompt_tokens = Counter("specdec:prompt_tokens_forked", "Prompt tokens a request copied from "
                                            "another's cache row (one prefill for OpenAI's n choices)", registry=r)
        self.preemptions = Counter("specdec:num_preemptions", "Requests whose cache blocks were taken back while "
                                   "the KV pool ran dry (recomputed when admitted again)", registry=r)
        self.prefix_queries = Counter("specdec:prefix_cache_queries", "Admitted requests looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("specdec:prefix_cache_hits", "Requests that started from a stored prefix",
                                   registry=r)
        self.cached_prompt_tokens = Counter("specdec:prompt_tokens_cached", "Prompt tokens copied from the prefix "
                                            "cache instead of computed", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram("specdec:inter_token_latency_seconds",
                                     "Time per output token after the first (a step's interval over its tokens)",
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.requests = Counter("specdec:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.totals = {"drafted": 0, "accepted": 0, "drafting_steps": 0, "from_cache": 0}

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_step(self, batch: int, draft_length: float, outcomes: Sequence[StepOutcome]) -> None:
        self.batch_size.observe(batch)
        self.draft_length.set(draft_length)
        for outcome in outcomes:
            if outcome.forced:
                self.forced_tokens.inc(outcome.num_accepted)
            elif outcome.drafter is not None:
                self.drafter_steps.labels(drafter=outcome.drafter).inc()
                self.drafter_accepted.labels(drafter=outcome.drafter).inc(outcome.num_accepted)
                if outcome.drafter == PREDICTION:
                    self.prediction_tokens.labels(outcome="accepted").inc(outcome.num_accepted)
                    self.prediction_tokens.labels(outcome="rejected").inc(outcome.num_drafted - outcome.num_accepted)
            if not outcome.num_drafted or outcome.forced:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(outcome.num_drafted)
            self.accepted_tokens.inc(outcome.num_accepted)
            self.accepted_from_cache.inc(outcome.accepted_from_cache)
            self.relaxed_accepted.inc(len(outcome.relaxed))
            for position in range(outcome.num_accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()
            self.totals["drafted"] += outcome.num_drafted
            self.totals["accepted"] += outcome.num_accepted
            self.totals["drafting_steps"] += 1
            self.totals["from_cache"] += outcome.accepted_from_cache
        if self.totals["drafted"]:
            self.acceptance_rate.set(self.totals["accepted"] / self.totals["drafted"])
            self.mean_acceptance_length.set(1 + self.totals["accepted"] / self.totals["drafting_steps"])

    def observe_chunk(self, tokens: int, now: float, submitted: float, last_emit: float | None) -> None:
        """A chunk of ``tokens`` reached at ``now`` a request submitted at ``submitted`` whose last
        chunk came at ``last_emit`` (None: this is its first)."""
        if tokens == 0:
            return
        self.generation_tokens.inc(tokens)
        if last_emit is None:  # the first chunk's tokens arrive with the first token
            self.ttft.observe(now - submitted)
            return
        for _ in range(tokens):
            self.inter_token.observe((now - last_emit) / tokens)

    def observe_prefill(self, computed: int, forked: int) -> None:
        self.prompt_tokens.inc(computed)
        self.forked_prompt_tokens.inc(forked)

    def observe_prefix_query(self, reused: int) -> None:
        self.prefix_queries.inc()
        if reused:
            self.prefix_hits.inc()
            self.cached_prompt_tokens.inc(reused)

    def finished(self, reason: str) -> None:
        self.requests.labels(finished_reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
