"""An int4 or w8a32 model's compiled layer ops (specdec/models/int4_layer.py): close to the torch
layer, each row the same alone as in a block, checked at load; refused, with a notice, when wrong."""

import pytest
import torch
from tiny import save_random_model

from specdec.models import int4_layer
from specdec.models.loading import load


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))


def _scaled(function, factor):
    return lambda *args: function(*args) * factor


def _row_dependent(function):
    """Right for one row; a block's rows nudged by 1e-6 (as a kernel blocking by row count would)."""
    return lambda layer, x, *rest: function(layer, x, *rest) * (1 + 1e-6 * (x.shape[0] > 1))


@pytest.mark.parametrize("format", [4, 8])
def test_the_self_check_passes_here_and_refuses_wrong_layer_ops(monkeypatch, format):
    """Mutations: each piece 1e-3 off, or rows of a block differing from alone, fails the check."""
    assert int4_layer.check_layer(0, format) is None
    cases = {
        "mlp_block": (_scaled(int4_layer.mlp_block, 1 + 1e-3), "o + residual + norm + MLP off by"),
        "qkv_projection": (_row_dependent(int4_layer.qkv_projection), "norm + q/k/v + RoPE: a block's rows differ"),
    }
    for name, (wrong, says) in cases.items():
        with monkeypatch.context() as patch:
            patch.setattr(int4_layer, name, wrong)
            assert says in int4_layer.check_layer(0, format)
    original = int4_layer.attend_queries

    def attention_of_the_last_query_only(layer, q, k, v, queries, keys, values, out):
        original(layer, q, k, v, queries, keys, values, out)
        out[queries.tokens[:-1]] = 0.0  # forgets all but the last query of a list

    monkeypatch.setattr(int4_layer, "attend_queries", attention_of_the_last_query_only)
    assert "attention" in int4_layer.check_layer(0, format)


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
@pytest.mark.parametrize("model_type, settings", [("qwen2", {}), ("mistral", {"sliding_window": 6})])
def test_a_packed_model_runs_its_layers_compiled_close_to_the_torch_layers(model_dir, model_type, settings,
                                                                           monkeypatch, quantize):
    """The same int4 (w8a32) weights through the compiled ops and through torch's: logits close
    (other summation orders, and for int4 now and then another int8 rounding of an activation)."""
    folder = save_random_model(model_dir / f"int4-layer-{model_type}", model_type, seed=7, **settings)
    model = load(folder, quantize=quantize)
    network = model.network
    assert all(layer.fused for layer in network.layers) and network.fused_output
    assert network.quantize_notice.endswith("; layer ops compiled")
    calls = []
    for name in ("qkv_projection", "attend_queries", "mlp_block", "norm_then_linear"):
        original = getattr(int4_layer, name)
        monkeypatch.setattr(int4_layer, name, lambda *args, name=name, original=original: (calls.append(name),
                                                                                          original(*args))[1])
    tokens = torch.arange(3, 19)
    compiled = [model.extend(tokens[:10], cache := model.new_cache()), model.extend(tokens[10:], cache)]
    layers = len(network.layers)
    # The prefill attends with SDPA (masked), the block after it query by query in the compiled attention.
    assert calls.count("qkv_projection") == calls.count("mlp_block") == 2 * layers
    assert calls.count("attend_queries") == layers and calls.count("norm_then_linear") == 2
    for layer in network.layers:
        layer.fused = False
    network.fused_output = False
    in_torch = [model.extend(tokens[:10], cache := model.new_cache()), model.extend(tokens[10:], cache)]
    for fast, slow in zip(compiled, in_torch, strict=True):
        assert (fast - slow).abs().max() < (0.02 if quantize == "int4" else 1e-5) * slow.abs().max()


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_wrong_layer_ops_leave_the_torch_layer_with_a_one_line_notice(model_dir, monkeypatch, quantize):
    monkeypatch.setattr(int4_layer, "layer_problem", lambda format: "attention off by 0.1 (relative)")
    folder = save_random_model(model_dir / "int4-layer-refused", "llama", seed=8)
    model = load(folder, quantize=quantize)
    assert model.precision == quantize and not any(layer.fused for layer in model.network.layers)
    assert not model.network.fused_output
    notice = model.network.quantize_notice
    assert notice.endswith("; layer ops not compiled (attention off by 0.1 (relative))") and "\n" not in notice
