"""`specdec bench --synthetic` on tiny shapes: the corrupted-oracle drafter, the weight-byte count,
the Leviathan prediction and the report."""

import json
import math

import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.bench.synthetic import CorruptedOracleDrafter, Shape, random_model, streamed_weight_bytes
from specdec.commands.cli import main
from specdec.core.drafts import ContextRequest
from specdec.core.estimates import expected_tokens_per_step, predicted_speedup

TINY_TARGET, TINY_DRAFT = Shape(128, 2, 512), Shape(64, 1, 512)


def test_leviathan_formula():
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(1.0, 4) == 5
    assert expected_tokens_per_step(0.0, 4) == 1
    # free drafting and free verification: the speedup is the tokens per step
    assert predicted_speedup(0.8, 3, 0.0, 1.0) == pytest.approx(expected_tokens_per_step(0.8, 3))
    assert predicted_speedup(0.8, 3, 0.1, 1.5) == pytest.approx(expected_tokens_per_step(0.8, 3) / 1.8)


def test_streamed_weight_bytes_count_every_linear_once():
    norms = TINY_TARGET.hidden * (2 * TINY_TARGET.layers + 1)
    fp32 = random_model(TINY_TARGET, "t", 0, None)
    assert sum(p.numel() for p in fp32.network.parameters()) == TINY_TARGET.parameters
    # tied embeddings: the table is streamed once, as the LM head
    assert streamed_weight_bytes(fp32.network) == 4 * TINY_TARGET.parameters
    int8 = random_model(TINY_TARGET, "t", 0, "int8")
    linears = TINY_TARGET.parameters - norms
    out_channels = sum(m.out_features for m in int8.network.modules() if hasattr(m, "weight_scale"))
    assert streamed_weight_bytes(int8.network) == linears + 4 * norms + 4 * out_channels  # + fp32 scales


def test_shape_parse_rejects_bad_text():
    assert Shape.parse("1024x24", 32000) == Shape(1024, 24, 32000)
    with pytest.raises(ValueError, match="HIDDENxLAYERS"):
        Shape.parse("1024", 32000)
    with pytest.raises(ValueError, match="multiple of 64"):
        Shape.parse("100x2", 32000)


def test_corrupted_oracle_accepts_each_position_with_probability_alpha():
    target, draft = random_model(TINY_TARGET, "t", 0, None), random_model(TINY_DRAFT, "d", 1, None)
    prompt = list(range(5, 21))
    expected = prompt + SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    drafter = CorruptedOracleDrafter(draft, alpha=0.7, vocab_size=TINY_TARGET.vocab, seed=3)
    drafter.expect(expected)
    context = torch.tensor(expected[:20])
    correct, trials = 0, 0
    for _ in range(400):
        tokens = drafter.propose(ContextRequest.started(drafter, context), 4).tokens.tolist()
        assert len(tokens) == 4 and all(0 <= t < TINY_TARGET.vocab for t in tokens)
        correct += sum(a == b for a, b in zip(tokens, expected[20:24], strict=True))
        trials += 4
    sigma = math.sqrt(0.7 * 0.3 / trials)
    assert abs(correct / trials - 0.7) < 4 * sigma
    assert drafter.off_reference == 0


@pytest.mark.slow
def test_synthetic_bench_reports_measured_and_predicted_speedups(tmp_path, capsys):
    out = tmp_path / "synthetic"
    code = main(["bench", "--synthetic", "--synthetic-target", "128x2", "--synthetic-draft", "64x1",
                 "--synthetic-vocab", "512", "--synthetic-prompts", "2", "--alphas", "0", "1", "--gammas", "3",
                 "--max-new-tokens", "12", "--repeats", "2", "--out", str(out)])
    assert code == 0  # greedy outputs equalled target-only's, or the identity check would have raised
    payload = json.loads((out / "synthetic.json").read_text())
    assert [r["precision"] for r in payload["precisions"]] == ["fp32", "int8"]
    for result in payload["precisions"]:
        runs = {r["alpha"]: r for r in result["runs"]}
        assert runs[1.0]["first_position_acceptance"] == 1.0 and runs[1.0]["accepted_per_drafted"] == 1.0
        assert runs[0.0]["first_position_acceptance"] == 0.0 and runs[0.0]["tau"] == 1.0
        verify_ratio = result["target_forward_ms"]["4"] / result["target_forward_ms"]["1"]
        assert runs[1.0]["predicted_speedup"] == pytest.approx(4 / (3 * result["c"] + verify_ratio))
        assert result["bandwidth_bound_ms_per_token"] > 0 and result["target_only_ms_per_token"] > 0
    assert "Leviathan prediction" in (out / "synthetic.md").read_text()
    assert (out / "synthetic.png").stat().st_size > 1000


def test_synthetic_bench_refuses_model_folders(tmp_path):
    assert main(["bench", "--synthetic", "--target", str(tmp_path), "--out", str(tmp_path / "x")]) != 0
