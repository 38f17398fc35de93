"""`specdec explain --calculator`: Leviathan et al.'s closed form, and the best gamma."""

import pytest

from specdec.commands.cli import main
from specdec.explain.calculator import best_row, speedup_table


@pytest.mark.parametrize("alpha, c", [(0.8, 0.1), (0.5, 0.05), (0.95, 0.3), (0.0, 0.2), (1.0, 0.1)])
def test_rows_equal_the_closed_form(alpha, c):
    rows = speedup_table(alpha, c, max_gamma=12)
    for row in rows:
        # E counts the first rejection's correction or the bonus: sum of alpha^i, i = 0..gamma.
        expected = sum(alpha ** i for i in range(row.gamma + 1))
        assert row.expected_tokens == pytest.approx(expected)
        assert row.speedup == pytest.approx(expected / (row.gamma * c + 1))
    assert best_row(rows).speedup == max(expected_speedup for expected_speedup in (r.speedup for r in rows))


def test_a_verify_cost_curve_divides_each_gamma():
    costs = [1.0 + 0.1 * gamma for gamma in range(1, 5)]
    rows = speedup_table(0.7, 0.05, max_gamma=4, costs=costs)
    for row, cost in zip(rows, costs, strict=True):
        assert row.speedup == pytest.approx(sum(0.7 ** i for i in range(row.gamma + 1)) / (row.gamma * 0.05 + cost))


def test_cli_marks_the_best_gamma(capsys):
    assert main(["explain", "--calculator", "--alpha", "0.8", "--c", "0.1"]) == 0
    out = capsys.readouterr().out
    best = best_row(speedup_table(0.8, 0.1))
    assert best.gamma == 6  # sum 0.8^i / (0.1 gamma + 1) peaks at gamma 6 (2.470x; 2.460 at 5, 2.448 at 7)
    assert f"best gamma: {best.gamma} ({best.expected_tokens:.3f} tokens per step, {best.speedup:.3f}x" in out


@pytest.mark.parametrize("argv, message", [
    (["--alpha", "1.5", "--c", "0.1"], "--alpha must lie in [0, 1]"),
    (["--alpha", "0.5"], "--calculator needs --alpha A and --c C"),
    (["--alpha", "0.5", "--c", "0.1", "--max-gamma", "3", "--verify-cost", "1", "2"], "one per gamma 1..3"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["explain", "--calculator", *argv]) == 2
    assert message in capsys.readouterr().err
