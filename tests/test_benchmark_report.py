"""benchmarks/report.py: docs/benchmarks.md and the README's headline table are made from the
registry and the result files, figure for figure, and CI's --check catches a stale page."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
assert spec is not None and spec.loader is not None
report = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report  # dataclasses look their module up while the file runs
spec.loader.exec_module(report)

README_STUB = f"# stub\n\n{report.HEADLINE_START}\n{report.HEADLINE_END}\n\nafter\n"


def write_run(root: Path, folder: str, date: str, rates: dict[str, float], mismatches: tuple[str, ...] = ()) -> str:
    """A results.json as `specdec bench` writes it (the fields report.py reads), at root/folder."""
    engines = {"llama-target": "llama.cpp", "llama-lookup": "llama.cpp"}
    summaries = [{"method": name, "engine": engines.get(name, "specdec"), "category": category,
                  "prompts": 4 if category == "all" else 2, "tokens_per_second": rate}
                 for name, rate in rates.items() for category in ("code-completion", "all")]
    data = {"date": date, "settings": {"temperature": 0.0, "max_new_tokens": 64}, "suite": "bundled",
            "summaries": summaries, "mismatches": [{"method": name} for name in mismatches]}
    path = root / folder / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return f"{folder}/results.json"


def registry(root: Path, runs: list[tuple[str, str, str]]) -> Path:
    """results.toml with one machine and runs (id, result path, methods of the command)."""
    text = '[machines.m]\nname = "Test CPU"\nisa = "avx2"\nnote = "a note"\n'
    for run_id, result, methods in runs:
        text += (f'\n[[runs]]\nid = "{run_id}"\nmachine = "m"\npair = "real"\nprecision = "int4"\n'
                 f'headline = true\nresult = "{result}"\n'
                 f'command = "specdec bench --methods {methods} --max-new-tokens 64"\n')
    (root / "benchmarks").mkdir(exist_ok=True)
    (root / "benchmarks" / "results.toml").write_text(text)
    (root / "docs").mkdir(exist_ok=True)
    (root / "README.md").write_text(README_STUB)
    return root / "benchmarks" / "results.toml"


RATES = {"target-only": 30.25, "auto": 44.61, "ngram:cost": 40.04, "llama-target": 27.63, "llama-lookup": 19.9}


def test_every_figure_is_read_from_the_result_file(tmp_path):
    """Mutation tried: figure() printing a fixed "44.6" instead of the method's rate: the second
    render still shows 44.6 and the assertion on 50.2 fails."""
    result = write_run(tmp_path, "runs/a", "2026-11-27T15:55:00", RATES)
    path = registry(tmp_path, [("a", result, "auto ngram:cost llama-target llama-lookup")])
    page = report.outputs(path, tmp_path)[tmp_path / "docs" / "benchmarks.md"]
    row = next(line for line in page.splitlines() if line.startswith("| real, int4"))
    assert "| 30.2 |" in row and "44.6 (1.47x)" in row and "| 27.6 |" in row and "llama-lookup 19.9" in row
    assert "[JSON](../runs/a/results.json)" in row and "[command](#a)" in row
    data = json.loads((tmp_path / result).read_text())
    for summary in data["summaries"]:
        if summary["method"] == "auto":
            summary["tokens_per_second"] = 50.2
    (tmp_path / result).write_text(json.dumps(data))
    page = report.outputs(path, tmp_path)[tmp_path / "docs" / "benchmarks.md"]
    assert "50.2 (1.66x)" in page and "44.6" not in page


def test_the_latest_run_of_a_configuration_is_shown_and_older_ones_listed(tmp_path):
    """Mutation tried: `run.date > latest[...].date` as `<`: the older run's 44.6 fills the row."""
    old = write_run(tmp_path, "runs/old", "2026-11-25T10:00:00", RATES)
    new = write_run(tmp_path, "runs/new", "2026-11-27T10:00:00", {**RATES, "auto": 47.0})
    methods = "auto ngram:cost llama-target llama-lookup"
    path = registry(tmp_path, [("old", old, methods), ("new", new, methods)])
    outputs = report.outputs(path, tmp_path)
    page, readme = outputs[tmp_path / "docs" / "benchmarks.md"], outputs[tmp_path / "README.md"]
    rows = [line for line in page.splitlines() if line.startswith("| real, int4")]
    assert len(rows) == 1 and "47.0" in rows[0] and "44.6" not in rows[0]
    assert "Superseded: [2026-11-25 real bundled](../runs/old/results.json)." in page
    headline = [line for line in readme.splitlines() if line.startswith("| Test CPU")]
    assert len(headline) == 1 and "auto 47.0 (1.55x); 1.70x llama-completion" in headline[0]
    assert readme.endswith("\n\nafter\n")  # the text around the markers is kept


def test_a_specdec_output_that_differs_is_said_on_its_row(tmp_path):
    """Mutation tried: counting every mismatch, llama.cpp's included: the row says 2 differ."""
    result = write_run(tmp_path, "runs/a", "2026-11-27T15:55:00", RATES, mismatches=("auto", "llama-lookup"))
    path = registry(tmp_path, [("a", result, "auto ngram:cost llama-target llama-lookup")])
    outputs = report.outputs(path, tmp_path)
    assert "| **1 differ** |" in outputs[tmp_path / "docs" / "benchmarks.md"]
    assert "**1 specdec outputs differ from its target-only**" in outputs[tmp_path / "README.md"]


@pytest.mark.parametrize("command_methods, max_new_tokens, message", [
    ("auto ngram:cost llama-target", 64, "are not the file's methods"),
    ("auto ngram:cost llama-target llama-lookup", 128, "--max-new-tokens 128 in the command"),
])
def test_a_command_that_did_not_write_the_file_is_refused(tmp_path, command_methods, max_new_tokens, message):
    """Mutation tried: check_command returning at once: no error is raised."""
    result = write_run(tmp_path, "runs/a", "2026-11-27T15:55:00", RATES)
    path = registry(tmp_path, [("a", result, command_methods)])
    path.write_text(path.read_text().replace("--max-new-tokens 64", f"--max-new-tokens {max_new_tokens}"))
    with pytest.raises(report.RegistryError, match=message):
        report.load(path, tmp_path)


def test_check_finds_a_stale_page(tmp_path):
    """Mutation tried: stale_files comparing only that the file exists: the edited page passes."""
    result = write_run(tmp_path, "runs/a", "2026-11-27T15:55:00", RATES)
    path = registry(tmp_path, [("a", result, "auto ngram:cost llama-target llama-lookup")])
    for file, text in report.outputs(path, tmp_path).items():
        file.write_text(text)
    assert report.stale_files(path, tmp_path) == []
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text(page.read_text().replace("44.6", "45.6"))
    assert report.stale_files(path, tmp_path) == [page]


def test_the_committed_page_and_readme_are_current_and_short():
    """What CI's `report.py --check` asserts, on the repository itself, and the line budgets of
    issue 55 (benchmarks page <= 250 lines, README <= 200). Mutation tried: a figure edited by
    hand in docs/benchmarks.md: stale_files names it."""
    assert report.stale_files() == []
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 250
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
