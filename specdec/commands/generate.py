"""`specdec generate`: one prompt, streamed to the terminal, with the statistics after it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from specdec.commands.views import stats_table
from specdec.names import help_formatter
from specdec.progress import waiting

# How --show colours each token: a person sees which tokens the draft got right.
# (Keyed by specdec.text.TokenSource's values: this module imports no torch until it runs.)
SOURCE_STYLES = {
    "draft": "green",
    "branch": "cyan",
    "cache": "magenta",
    "corpus": "bright_magenta",
    "prediction": "bright_green",
    "relaxed": "bold dark_orange",
    "forced": "yellow",
    "correction": "bold red",
    "bonus": "bold blue",
    "target": "",
}


def add_parser(commands, add_model_options, add_sampling_options, add_drafting_options) -> None:
    generate = commands.add_parser("generate", help="generate text from a prompt, speculatively",
                                   formatter_class=help_formatter())
    generate.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin")
    generate.add_argument("--prompt-file", help="read the prompt from this file (- for stdin): multi-line prompts")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the tokenizer's "
                                                              "chat template (Instruct models)")
    generate.add_argument("--system", help="with --chat: a system message first")
    add_model_options(generate)
    add_sampling_options(generate)
    add_drafting_options(generate)
    structure = generate.add_argument_group("structured output (the text must match; docs/structured.md)")
    only_one = structure.add_mutually_exclusive_group()
    only_one.add_argument("--json-schema", metavar="FILE", help="JSON matching this JSON schema")
    only_one.add_argument("--json-object", action="store_true", help="any JSON object")
    only_one.add_argument("--regex", metavar="R", help="text matching this regular expression")
    only_one.add_argument("--grammar", metavar="FILE", help="text in this grammar (Lark, or llama.cpp's GBNF)")
    structure.add_argument("--no-forced-tokens", action="store_true",
                           help="do not draft the tokens the grammar forces (they cost a target forward each then)")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--prediction", metavar="FILE",
                          help="the output you expect (OpenAI's predicted outputs: for an edit, the file as it is "
                               "now): drafted from where the output is in it; the text stays the target's")
    generate.add_argument("--no-draft", action="store_true", help="run the target alone (the baseline)")
    generate.add_argument("--show", action="store_true",
                          help="colour tokens: green = accepted draft, cyan = accepted from a tree's other branch, "
                               "magenta = accepted draft copied from an earlier request's output (suffix drafters' "
                               "cache), bright magenta = retrieved from a datastore (--index), bright green = "
                               "copied from --prediction, yellow = forced by "
                               "the grammar, orange = kept by a lossy --acceptance only, "
                               "red = target's correction, blue = bonus")
    generate.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                          help="then run the target alone on the same prompt: measured speedup, and whether the text "
                               "is the same (default: on for the default pair, off with --target)")
    generate.add_argument("--json", action="store_true",
                          help="write one JSON object (text, finish reason, stats) to stdout instead of streaming")
    generate.add_argument("--no-echo", action="store_true",
                          help="write only the generated text to stdout (by default the prompt comes first, so that "
                               "`--prompt-file f.py > out.py` holds the prompt and its continuation, byte for byte)")


def decode_prompt(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"the prompt from {where} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return decode_prompt(sys.stdin.buffer.read(), "stdin")
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
        return decode_prompt(path.read_bytes(), str(path))
    if args.prompt is None:
        raise ValueError("no prompt: pass one, or --prompt-file FILE (- for stdin)")
    if args.prompt == "-":
        return decode_prompt(sys.stdin.buffer.read(), "stdin")
    # A command-line argument that was not valid UTF-8 arrives with surrogate escapes.
    return decode_prompt(args.prompt.encode("utf-8", "surrogateescape"), "the command line")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the command line, a file or stdin; an empty one is an error (before any
    model loads)."""
    text = prompt_text(args)
    if not text:
        raise ValueError("the prompt is empty")
    return text


def write_text(console: Console, pieces: list[tuple[str, str]]) -> None:
    """(text, style) pieces to stdout exactly as they are: styled through rich on a terminal
    (never wrapped), else as raw text (rich would wrap, expand tabs and drop carriage returns),
    so that stdout redirected to a file holds the prompt and the generated text byte for byte."""
    if console.is_terminal:
        line = Text()
        for piece, style in pieces:
            line.append(piece, style=style)
        console.print(line, end="", soft_wrap=True)
    else:
        console.file.write("".join(piece for piece, _ in pieces))
    console.file.flush()


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from specdec.commands.models import load_drafting
    from specdec.commands.options import sampling_from_args

    # Everything that can be wrong with the arguments is said before the models (and torch) load.
    text = read_prompt(args)
    if args.system and not args.chat:
        raise ValueError("--system needs --chat")
    prediction = None
    if args.prediction:
        path = Path(args.prediction)
        if not path.is_file():
            raise FileNotFoundError(f"--prediction file not found: {path}")
        prediction = path.read_text(encoding="utf-8", errors="replace")
    sampling = sampling_from_args(args, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ()),
                                  prediction=prediction)
    from specdec.core.drafts import describe_drafter
    from specdec.decoder import GenerationResult, SpeculativeDecoder
    from specdec.text import chat_prompt_ids, encode_prompt

    drafting = load_drafting(args, errors)
    target, config = drafting.target, drafting.config
    decoder = drafting.decoder()
    drafter = decoder.engine.drafter
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
        prompt = chat_prompt_ids(target.tokenizer, messages)
    else:
        prompt = encode_prompt(target.tokenizer, text, target.name)
    decoder.engine.check_prompt(prompt)  # a prompt too long for the context fails before it is echoed
    compare = drafter is not None and (args.compare if args.compare is not None else not args.target)

    def target_alone():
        with waiting(errors, "running the target alone on the same prompt, for comparison"):
            alone = dataclasses.replace(sampling, acceptance="exact")  # no draft: nothing to relax
            return SpeculativeDecoder(target, draft_forced=False).generate(prompt, alone)  # plain decoding

    if args.json:
        result = decoder.generate(prompt, sampling)
        payload = {"text": result.text, "finish_reason": result.finish_reason, **result.stats.to_dict()}
        if compare:
            baseline = target_alone()
            payload["target_alone"] = {
                "text": baseline.text,
                "same_text": baseline.text == result.text,
                **baseline.stats.to_dict(),
            }
        console.file.write(json.dumps(payload) + "\n")
        return 0
    if not args.chat and not args.no_echo:
        write_text(console, [(text, "dim")])
    streamed: GenerationResult | None = None
    for chunk in decoder.stream(prompt, sampling):
        write_text(console, [(piece, SOURCE_STYLES[source] if args.show else "") for piece, source in chunk.pieces])
        streamed = chunk.result or streamed
    assert streamed is not None, "a stream's last chunk holds the result"
    if console.is_terminal:
        console.print()
    if args.show:
        console.file.flush()
        if not console.is_terminal:  # the text ends without a newline (piped: its bytes exactly)
            errors.print()  # so the legend starts a line of its own where both streams meet (2>&1)
        legend = Text("tokens: ")
        for source, style in SOURCE_STYLES.items():
            if style:
                legend.append(f"{source} ", style=style)
        errors.print(legend)
    title = (
        "target only"
        if drafter is None
        else f"speculative decoding: {describe_drafter(drafter)}; "
        f"{getattr(decoder.engine.policy, 'name', 'no')} policy, gamma {config.chosen_gamma}"
    )
    baseline = target_alone() if compare else None
    errors.print(
        stats_table(
            streamed.stats,
            title,
            streamed.finish_reason,
            baseline and baseline.stats,
            baseline is not None and baseline.text == streamed.text,
            args.temperature > 0,
        )
    )
    return 0
