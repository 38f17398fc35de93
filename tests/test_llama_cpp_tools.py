"""llama.cpp's tools as `specdec bench` methods: command lines, log parsing, and a whole bench run
through stand-in binaries that print what the real tools print (the real ones are not in CI)."""

import json
import os
import stat
import sys
import textwrap

import pytest

from specdec.bench.llama_cpp_tools import (
    LOOKAHEAD,
    LlamaCppTools,
    ToolError,
    command_line,
    parse_timing,
    server_command,
)
from specdec.commands.cli import main
from specdec.core.sampling import SamplingParams

SPECULATIVE_LOG = """\
0.17.988.609 I encoded   13 tokens in    1.087 seconds, speed:   11.964 t/s
0.17.988.624 I decoded   33 tokens in    6.620 seconds, speed:    4.985 t/s
0.17.988.652 I n_drafted = 36
0.17.988.659 I n_accept  = 26
0.17.988.729 I common_perf_print: prompt eval time =    3450.72 ms /    55 tokens (   62.74 ms per token)
"""
COMPLETION_LOG = """\
0.15.893.675 I common_perf_print: prompt eval time =    1091.59 ms /    13 tokens (   83.97 ms per token)
0.15.893.676 I common_perf_print:        eval time =    5856.30 ms /    31 runs   (  188.91 ms per token)
"""


def test_parse_timing_reads_each_tools_log():
    assert parse_timing(SPECULATIVE_LOG) == (1.087, 6.620, 33)  # its own encode/decode lines, not perf's
    assert parse_timing(COMPLETION_LOG) == pytest.approx((1.09159, 5.8563, 32))  # the first token comes from the prompt
    with pytest.raises(ToolError, match="no timing"):
        parse_timing("nothing here")


def test_command_lines_carry_the_fast_flags_and_the_sampling(tmp_path):
    tools = LlamaCppTools(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf")
    settings = SamplingParams(max_new_tokens=9, temperature=0.8, top_k=5, seed=3)
    spec = command_line("llama-speculative:4", tools, "hi", settings)
    assert spec[0].endswith("llama-speculative") and spec[spec.index("-md") + 1].endswith("d.gguf")
    assert spec[spec.index("--poll") + 1] == "0" and spec[spec.index("--spec-draft-n-max") + 1] == "4"
    assert spec[spec.index("--temp") + 1] == "0.8" and spec[spec.index("--min-p") + 1] == "0.0"
    assert (
        spec[spec.index("-n") + 1] == str(9 + LOOKAHEAD)
        and spec[spec.index("-p") + 1] == "hi"
        and "--no-escape" in spec
    )
    lookup = command_line("llama-lookup", tools, "hi", settings)
    assert lookup[lookup.index("--spec-draft-n-max") + 1] == "6" and "-md" not in lookup
    assert command_line("llama-target", tools, "hi", settings)[0].endswith("llama-completion")
    assert spec[spec.index("-c") + 1] == "4096"  # llama.cpp's own default, at least
    long = command_line("llama-target", tools, "hi", settings, prompt_tokens=16000)
    assert long[long.index("-c") + 1] == "16128"  # the prompt and the generation, in 256-token steps
    server = server_command(tools, 16128, 8999)
    assert server[0].endswith("llama-server") and "--spec-default" in server and server[server.index("-np") + 1] == "1"
    assert server[server.index("--port") + 1] == "8999" and server[server.index("-c") + 1] == "16128"


FAKE_TOOL = textwrap.dedent("""\
    #!{python}
    # Prints what llama.cpp's tool of this file's name prints: the prompt, a continuation, a timing log.
    import os, sys
    args = sys.argv[1:]
    prompt, count = args[args.index("-p") + 1], int(args[args.index("-n") + 1])  # -n is the bench's + LOOKAHEAD
    name = os.path.basename(sys.argv[0])
    words = ["x"] * (count + 2) if name == "llama-lookup" and {wrong} else ["a", "b"] * count
    sys.stdout.write("\\n\\n" + prompt + "".join(words[:count + 2]))  # two past -n, as the tools may do
    if name == "llama-completion":
        sys.stderr.write("prompt eval time =  10.0 ms /  3 tokens\\n       eval time =  90.0 ms /  {{}} runs\\n".format(count - 1))
    else:
        sys.stderr.write("encoded 3 tokens in 0.010 seconds\\ndecoded {{}} tokens in 0.090 seconds\\n".format(count + 2))
        sys.stderr.write("n_drafted = 8\\nn_accept = 6\\n")
""")


FAKE_SERVER = textwrap.dedent("""\
    #!{python}
    # Answers as llama-server does: /health, then /completion with the continuation and timings.
    import http.server, json, sys
    args = sys.argv[1:]
    assert "--spec-default" in args

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({{"status": "ok"}})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            count = request["n_predict"]  # the bench's + LOOKAHEAD
            self.reply({{"content": "".join((["a", "b"] * count)[:count]),
                        "timings": {{"prompt_n": 3, "prompt_ms": 20.0, "predicted_n": count, "predicted_ms": 80.0,
                                    "draft_n": 10, "draft_n_accepted": 4}}}})

        def log_message(self, *arguments):
            pass

    http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
""")


def fake_tools(folder, wrong_lookup: bool):
    folder.mkdir()
    for name in ("llama-completion", "llama-speculative", "llama-lookup", "llama-server"):
        path = folder / name
        path.write_text((FAKE_SERVER if name == "llama-server" else FAKE_TOOL).format(python=sys.executable,
                                                                                    wrong=wrong_lookup))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    for name in ("t.gguf", "d.gguf"):
        (folder / name).write_bytes(b"GGUF")
    return folder


@pytest.mark.parametrize("wrong_lookup", [False, True])
def test_bench_runs_llama_cpp_tools_against_their_own_target(tiny_pair, tmp_path, wrong_lookup):
    tools = fake_tools(tmp_path / "bin", wrong_lookup)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"category": "code", "prompt": "def f(x): return", "id": "a"}]))
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["same"]), "--prompts",
                 str(prompts), "--methods", "model:fixed", "llama-target", "llama-speculative:4", "llama-lookup",
                 "llama-server-spec",
                 "--llama-cpp-bin", str(tools), "--target-gguf", str(tools / "t.gguf"), "--draft-gguf", str(tools /
                 "d.gguf"), "--max-new-tokens", "6", "--out", str(out), "--repeats", "1"])
    payload = json.loads((out / "results.json").read_text())
    assert payload["identity_references"] == {"specdec": "target-only", "llama.cpp": "llama-target"}
    rows = {row["method"]: row for row in payload["measurements"]}
    assert rows["llama-target"]["tokens"] == 6 and rows["llama-speculative:4"]["tokens"] == 6  # cut at -n
    produced = 6 + LOOKAHEAD
    assert rows["llama-target"]["seconds"] == pytest.approx(0.01 + 0.09 * 6 / produced)  # scaled to the kept
    assert rows["llama-speculative:4"]["seconds"] == pytest.approx(0.01 + 0.09 * 6 / (produced + 2))
    assert rows["llama-server-spec"]["tokens"] == 6  # its own timings, scaled to the kept tokens:
    assert rows["llama-server-spec"]["seconds"] == pytest.approx(0.02 + 0.08 * 6 / produced)
    overall = {s["method"]: s for s in payload["summaries"] if s["category"] == "all"}
    assert overall["llama-speculative:4"]["alpha"] == 0.75 and overall["llama-speculative:4"]["tau"] is None
    assert overall["llama-server-spec"]["alpha"] == 0.4
    assert "llama-target" in overall["llama-lookup"]["speedup"]
    assert payload["failed_methods"] == (["llama-lookup"] if wrong_lookup else [])
    assert code == (1 if wrong_lookup else 0)


def test_missing_tools_are_one_line_errors(tiny_pair, tmp_path, capsys):
    base = ["bench", "--target", str(tiny_pair["target"]), "--methods", "llama-speculative"]
    assert main([*base, "--llama-cpp-bin", str(tmp_path)]) == 2
    assert "need both --llama-cpp-bin" in capsys.readouterr().err
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    assert main([*base, "--llama-cpp-bin", str(tmp_path), "--target-gguf", str(tmp_path / "t.gguf")]) == 2
    assert "llama-speculative needs" in capsys.readouterr().err
    if os.name == "posix":
        tools = fake_tools(tmp_path / "bin", False)
        assert main([*base, "--llama-cpp-bin", str(tools), "--target-gguf", str(tools / "t.gguf")]) == 2
        assert "needs --draft-gguf" in capsys.readouterr().err
