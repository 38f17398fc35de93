"""The commands' models: which target and draft a command line names (or the default pair),
loaded with the precision and backend chosen here, and what a command speculates with
(``Drafting``: the models, head and datastores its SpeculationConfig needs, loaded once; engines
built from them by specdec.assembly.build_engine)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console

from specdec.config import SpeculationConfig
from specdec.progress import dim_lines, waiting


def gguf_on_own_forward(target: str, backend: str) -> bool:
    """Whether ``target`` is a GGUF file that runs dequantized on the own forward."""
    from specdec.models.loading import gguf_backend

    return target.endswith(".gguf") and gguf_backend(backend) == "specdec"


def resolve_models(args: argparse.Namespace, errors: Console, reads_hidden: bool = False):
    """(target, draft, quantize, default pair or None): --target/--draft, or the default pair when
    no --target is given. --quantize unset on a CPU in float32 means, for the default SmolLM2 pair,
    w8a32 where the kernels compile (else the measured fastest exact of int8 and llama.cpp); for a
    --target on the own forward, the measured fastest exact precision (precision_choice; a GGUF
    starts from w8a32, its weights exactly); none otherwise. reads_hidden (a
    draft head reads the target's hidden states): --backend auto means the own forward, the one
    backend that gives them."""
    from specdec.defaults import default_pair

    if reads_hidden and args.backend == "auto":
        args.backend = "specdec"
    quantize = None if args.quantize == "none" else args.quantize
    if args.target:
        gguf = args.target.endswith(".gguf")
        own_forward = gguf_on_own_forward(args.target, args.backend) if gguf else args.backend in ("auto", "specdec")
        if args.quantize is None and own_forward and args.dtype == "float32" and args.device == "cpu":
            if gguf:
                quantize = "w8a32"  # its 4- and 8-bit weights exactly, float32 arithmetic
            from specdec.models.precision_choice import announce_precision

            chosen = announce_precision(args.target, "specdec" if gguf else args.backend, args.trust_remote_code,
                                        errors)
            if chosen is not None:
                quantize = chosen[0]
        return args.target, args.draft, quantize, None
    if args.draft:
        raise ValueError("--draft needs --target: the default draft only fits the default target")
    with waiting(errors, "preparing the default models") as update:
        pair = default_pair(update)
    target = pair.target
    if args.quantize is None and args.dtype == "float32" and args.device == "cpu":
        quantize = pair.quantize
        if args.backend in ("auto", "specdec") and pair.target_gguf is not None:
            from specdec.defaults import fastest_default_target

            with waiting(errors, "choosing the target's backend and precision") as update:
                target, quantize, why = fastest_default_target(pair, update, llama_cpp=args.backend == "auto")
            if why:
                errors.print(f"[dim]{why}[/]", highlight=False, soft_wrap=True)
    errors.print(f"[dim]default pair: {pair.name} ({pair.target.parent})[/]", highlight=False, soft_wrap=True)
    return str(target), str(pair.draft), quantize, pair


def load_models(args: argparse.Namespace, errors: Console, want_draft: bool = True, resolved=None):
    from specdec.models.loading import load

    target_path, draft_path, quantize, _ = resolved or resolve_models(args, errors)
    options = dict(
        dtype=args.dtype,
        device=args.device,
        quantize=quantize,
        backend=args.backend,
        trust_remote_code=args.trust_remote_code,
        exact=not args.inexact,
        kv_dtype=args.kv_dtype,
    )
    from specdec.models import quantize as int8

    with waiting(errors, "loading models") as update:
        int8.KERNELS.on_check = update
        try:
            # A GGUF target on llama.cpp keeps its own quantization; the draft keeps the chosen one.
            on_llama_cpp = target_path.endswith(".gguf") and not gguf_on_own_forward(target_path, args.backend)
            target = load(target_path, **{**options, "quantize": None} if on_llama_cpp else options)
            draft = load(draft_path, **options) if want_draft and draft_path else None
        finally:
            int8.KERNELS.on_check = None
    notices = [getattr(model.network, "quantize_notice", None) for model in (target, draft) if model is not None]
    notices += [int8.kernel_notice()] if quantize else []
    for notice in dict.fromkeys(notice for notice in notices if notice):
        errors.print(f"[dim]{notice}[/]", highlight=False, soft_wrap=True)
    return target, draft


@dataclass
class Drafting:
    """What a command speculates with, loaded once: the target, and the draft model, head and
    datastores its config asks for. ``engine()`` assembles an engine on them (build_engine); each
    has a drafter of its own, whose state (a suffix cache) its requests share, so servers compared
    side by side each get one. What runs is said once, in one line, for the first engine built."""

    target: Any  # LanguageModel
    config: SpeculationConfig
    draft: Any = None  # LanguageModel | None
    head: Any = None  # a head folder or None (build_engine finds the target's where one may draft)
    corpus: Sequence[Any] = ()
    errors: Console | None = None
    said: bool = field(default=False, compare=False)

    def engine(self, **options: Any):
        """build_engine on these models with the config; ``options``: build_engine's keywords
        (drafter_options, prefill_chunk, max_context, requests_choose_lengths, verify_hook)."""
        from specdec.assembly import build_engine
        from specdec.core.drafts import running_banner

        found: list[str] = []
        engine = build_engine(self.target, self.config, draft=self.draft, head=self.head, corpus=self.corpus,
                              say=found.append, **options)
        if not self.said and self.errors is not None:
            banner = running_banner(self.target, engine.drafter, self.config.chosen_policy, self.config.chosen_gamma)
            extra = f" ({found[0]})" if found and engine.drafter is not None else ""
            self.errors.print(f"[dim]{banner}{extra}[/]", highlight=False, soft_wrap=True)
            for line in getattr(engine.drafter, "describe_candidates", list)():  # auto's: a line each
                self.errors.print(f"[dim]  {line}[/]", highlight=False, soft_wrap=True)
            self.said = True
        return engine

    def decoder(self, **options: Any):
        """A SpeculativeDecoder around ``engine(**options)``."""
        from specdec.decoder import SpeculativeDecoder

        return SpeculativeDecoder.from_engine(self.engine(**options))


def load_drafting(args: argparse.Namespace, errors: Console) -> Drafting:
    """The models the command line's SpeculationConfig (``args.speculation_config``, built by
    check_arguments) drafts with, loaded once. Unset --drafter is auto: every drafter available
    here (a head found for the target by itself, the --draft model when given). A drafter that
    needs a draft model, given none, leaves the target alone (said in one line)."""
    from specdec.corpus_index import datastores_for
    from specdec.drafting import reads_target
    from specdec.names import AUTO, NO_DRAFTER, TEXT_DRAFTERS, base_kinds

    config: SpeculationConfig = args.speculation_config
    auto = config.drafter == AUTO
    # auto on a GGUF: the own forward, whose hidden states a head reads (llama.cpp's give none)
    resolved = resolve_models(args, errors, reads_hidden=bool(config.draft_head) or (
        config.drafts and reads_target(config.drafter)) or (auto and (args.target or "").endswith(".gguf")))
    pair = resolved[3]
    # auto takes a draft model only when one is named (the default pair's draft broke even: docs/default-pair.md)
    needs_model = config.drafts and (bool(args.draft) if auto else any(
        kind not in (*TEXT_DRAFTERS, "head", "head-tree") for kind in base_kinds(config.drafter)))
    target, draft = load_models(args, errors, want_draft=needs_model, resolved=resolved)
    if needs_model and draft is None:
        errors.print("[yellow]no --draft given: running the target alone[/]")
        config = replace(config, drafter=NO_DRAFTER, given=frozenset())
    head = config.draft_head or (pair.head if pair and target.backend == "specdec" else None)
    corpus = datastores_for(list(config.index) or None, target, dim_lines(errors)) if config.uses_corpus else []
    return Drafting(target, config, draft, head, corpus, errors)


def load_own_target(args: argparse.Namespace, errors: Console):
    """The target on specdec's own forward (what a draft head reads), for train-head."""
    args.draft = None
    return load_models(args, errors, want_draft=False, resolved=resolve_models(args, errors, reads_hidden=True))[0]


