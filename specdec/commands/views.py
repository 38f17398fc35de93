"""What the commands show of a finished generation: the statistics table (generate, explain)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from specdec.core.metrics import SpecStats


def stats_table(stats: SpecStats, title: str, finish_reason: str, baseline=None, same_text: bool | None = None,
                sampled: bool = False) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("new tokens", f"{stats.generated_tokens}"),
        ("finished by", finish_reason),
        ("target forwards", f"{stats.target_forwards}"),
        ("drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
        ("alpha (acceptance rate)", f"{stats.alpha:.3f}"),
        ("tau (tokens per target forward)", f"{stats.tau:.2f}"),
        # LOSSY acceptance, said wherever a result is shown
        *([("acceptance", f"LOSSY {stats.acceptance}"),
           ("accepted by the relaxed rule only", f"{stats.relaxed_accepted} of {stats.accepted}")]
          if stats.acceptance != "exact" else []),
        ("acceptance by position", " ".join(f"{a:.2f}" for a in stats.acceptance_by_position) or "-"),
        # A draft with another tokenizer: its own tokens, of which these survived translation.
        *(
            [("translated draft tokens", f"{stats.source_kept} of {stats.source_drafted} (draft's tokenizer)")]
            if stats.source_drafted
            else []
        ),
        *([("drafted by (auto's choice)", stats.drafter_summary())] if stats.by_drafter else []),
        *(
            [("from earlier requests (cache)", f"{stats.accepted_from_cache} accepted of {stats.drafted_from_cache} "
                                               "drafted")]
            if stats.drafted_from_cache
            else []
        ),
        *(
            [("forced by the grammar", f"{stats.forced_tokens} tokens in {stats.forced_steps} steps (drafted free)")]
            if stats.forced_steps
            else []
        ),
        *(
            [("time in the grammar engine",
              f"{stats.grammar_seconds * 1e3:.1f} ms ({stats.grammar_seconds * 1e3 / stats.generated_tokens:.3f} "
              "ms a token)")]
            if stats.grammar_seconds and stats.generated_tokens
            else []
        ),
        *(
            [("tree width by depth", " ".join(f"{w:.1f}" for w in stats.mean_tree_width))]
            if stats.tree_nodes_at
            else []
        ),
        (
            "time: prefill / draft / verify / rest",
            f"{stats.prefill_seconds:.3f} / {stats.draft_seconds:.3f} / "
            f"{stats.verify_seconds:.3f} / {stats.other_seconds:.3f} s",
        ),
        *(
            [("drafted from the prediction", "{} accepted, {} rejected".format(*stats.prediction_tokens))]
            if "prediction" in stats.by_drafter
            else []
        ),
        ("tokens per second", f"{stats.tokens_per_second:.1f}"),
    ]
    if baseline is not None:
        rows += [
            ("target alone: tokens per second", f"{baseline.tokens_per_second:.1f}"),
            ("speedup (measured, this prompt)", f"{stats.tokens_per_second / baseline.tokens_per_second:.2f}x"),
            (
                "same text as the target alone",
                "yes" if same_text else "no (lossy acceptance)" if stats.acceptance != "exact" else
                "no (sampling: the same distribution, other draws)" if sampled else "no",
            ),
        ]
    for name, value in rows:
        table.add_row(name, value)
    return table
