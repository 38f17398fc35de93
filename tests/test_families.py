"""Every family the own forward runs (architectures.FAMILIES), on tiny random models built from
transformers' own configs: the logits equal transformers' float32 logits (a prompt in pieces and a
ragged batch of two rows), greedy speculative output equals target-only in float32, int4 and w8a32
(chains, trees, n-gram), and the packed precisions run every layer on the compiled ops."""

import dataclasses

import pytest
import torch
from tiny import save_random_model

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.drafting import ModelTreeDrafter
from specdec.models.base import Attention, Segment
from specdec.models.fused_layer import FusedDecoderLayer
from specdec.models.transformer import UnsupportedByLeanModel

# Each family's own features turned on where a tiny config allows: head_dim 8 so that gemma's
# query_pre_attn_scalar differs from it, sliding windows shorter than the prompts.
FAMILY_SETTINGS = {
    "qwen3": dict(model_type="qwen3", head_dim=8),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=8, sliding_window=5, query_pre_attn_scalar=6,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "gemma2": dict(model_type="gemma2", head_dim=8, sliding_window=5, query_pre_attn_scalar=6),
    "gemma": dict(model_type="gemma", head_dim=8),
    "phi3": dict(model_type="phi3", pad_token_id=0),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite", embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=4.0),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, pad_token_id=0),  # layer 4 without RoPE
}


def save_family(folder, name: str, seed: int = 3, **extra):
    settings = {**FAMILY_SETTINGS[name], **extra}
    return save_random_model(folder, settings.pop("model_type"), seed=seed, **settings)


@pytest.fixture(scope="module", params=list(FAMILY_SETTINGS))
def family(request, model_dir):
    target = save_family(model_dir / f"family-{request.param}", request.param)
    draft = save_random_model(model_dir / f"family-{request.param}-draft", perturb_from=target, perturb_scale=0.05,
                              seed=9)
    return request.param, target, draft


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:  # [n] -> [n, vocab]
    with torch.no_grad():
        return model.network.model(input_ids=tokens[None]).logits[0]


def test_the_own_forward_runs_each_family_with_its_features(family):
    name, target, _ = family
    model = load(target, backend="specdec")
    assert model.backend == "specdec" and model.network.config.model_type == name
    config = model.network.config
    features = {"qwen3": config.qk_norm == "head", "gemma3_text": len(set(config.layer_ropes)) == 2,
                "gemma2": config.attention_softcap is not None and config.final_softcap is not None,
                "gemma": config.embedding_scale is not None, "phi3": True,
                "olmo2": config.qk_norm == "projection" and not config.pre_norms,
                "granite": config.logits_divisor == 4.0 and config.residual_scale == 0.5,
                "smollm3": None in config.layer_ropes}
    assert features[name]


def test_logits_equal_transformers_over_a_prompt_in_pieces(family):
    _, target, _ = family
    lean, reference = load(target, backend="specdec"), load(target, backend="transformers")
    tokens = torch.randint(0, lean.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    cache, pieces, start = lean.new_cache(), [], 0
    for size in [9, 1, 1, 4, 1, 8, 3, 5, 1, 7]:
        pieces.append(lean.extend(tokens[start:start + size], cache))
        start += size
    torch.testing.assert_close(torch.cat(pieces), reference_logits(reference, tokens), atol=1e-4, rtol=0)


def test_logits_equal_transformers_over_a_ragged_batch(family):
    """Two rows in one forward: a 7-token continuation after 12 tokens, and a 3-token first piece."""
    _, target, _ = family
    lean, reference = load(target, backend="specdec"), load(target, backend="transformers")
    generator = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, lean.vocab_size, (19,), generator=generator), \
        torch.randint(0, lean.vocab_size, (3,), generator=generator)
    cache = lean.new_cache(rows=2)
    lean.extend(first[:12], cache, row=0)
    tokens = torch.cat([first[12:], second])
    positions = torch.cat([torch.arange(12, 19), torch.arange(3)])
    logits = lean.forward(tokens, positions, cache, Attention((Segment(0, 7), Segment(1, 3)))).logits
    torch.testing.assert_close(logits[:7], reference_logits(reference, first)[12:], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[7:], reference_logits(reference, second), atol=1e-4, rtol=0)


@pytest.mark.parametrize("precision", ["float32", "int4", "w8a32"])
def test_greedy_speculative_output_equals_target_only(family, precision):
    """Chains of a perturbed draft (partly agreeing), trees of it, n-gram drafts and auto; the packed
    precisions on the compiled layer."""
    name, target_folder, draft_folder = family
    quantize = None if precision == "float32" else precision
    target = load(target_folder, quantize=quantize)
    if quantize is not None:
        kinds = {type(layer) for layer in target.network.layers}
        assert kinds == {FusedDecoderLayer}, kinds
    draft = load(draft_folder)
    drafters = {"chain": make_drafter("model", draft), "tree": ModelTreeDrafter(draft, budget=6, branching=2),
                "ngram": make_drafter("ngram", max_n=3), "auto": make_drafter("auto", target=target)}
    baseline = SpeculativeDecoder(target)
    accepted = 0
    for start in range(6):
        prompt = [(start * 11 + i * 5) % target.vocab_size for i in range(3 + start)] * 2
        expected = baseline.generate(prompt, max_new_tokens=16).token_ids
        for kind, drafter in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, max_new_tokens=16)
            assert result.token_ids == expected, (name, precision, kind, prompt)
            accepted += result.stats.accepted
    assert accepted > 0  # drafts were really verified and kept


def test_what_the_own_forward_cannot_run_is_said_in_one_line(model_dir):
    """dynamic NTK rope (its frequencies change at every length) refuses with the reason and runs
    on the adapter; a mixture of experts names itself."""
    from tiny import make_config

    from specdec.models.transformer import TransformerConfig

    dynamic = save_random_model(model_dir / "family-llama-dynamic", "llama",
                                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        load(dynamic, backend="specdec")
    assert load(dynamic).backend == "transformers"
    with pytest.raises(UnsupportedByLeanModel, match="mixture-of-experts"):
        TransformerConfig.from_hf(make_config("qwen3_moe"))


def test_a_head_trains_and_drafts_for_each_family(family, tmp_path, capsys):
    """`specdec train-head` on the family's tiny target (a few steps), then its head drafts in
    int4: the text is the target's alone."""
    import json
    from pathlib import Path

    import specdec
    from specdec.commands.cli import main

    _, target_folder, _ = family
    target = str(target_folder)
    train = ["train-head", "--target", target, "--out", str(tmp_path), "--data", str(Path(specdec.__file__).parent),
             "--steps", "6", "--sequence-length", "32", "--corpus-sequences", "8", "--continuation-sequences", "2",
             "--heldout-sequences", "2", "--draft-vocab", "64", "--batch-size", "4", "--precision", "float32"]
    assert main(train) == 0
    assert (tmp_path / "head" / "config.json").is_file()
    capsys.readouterr()
    outputs = []
    for options in (["--drafter", "head", "--draft-head", str(tmp_path / "head")], ["--no-draft"]):
        assert main(["generate", "def add(a, b):", "--target", target, "--quantize", "int4", "--max-new-tokens", "24",
                     "--json", *options]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["text"] == outputs[1]["text"]
    assert outputs[0]["drafted"] > 0  # the head really drafted


# Families whose GGUF files transformers' reader reads (architecture in the file -> model_type), with
# the tiny settings a GGUF keeps: qwen3's reader assumes head_dim 128, gemma's query_pre_attn_scalar 256.
GGUF_FAMILIES = {"qwen3": ("qwen3", {}), "phi3": ("phi3", dict(pad_token_id=0)),
                 "gemma2": ("gemma2", dict(head_dim=8, sliding_window=5)),
                 "gemma3_text": ("gemma3", dict(head_dim=8, sliding_window=5))}


@pytest.mark.parametrize("model_type", list(GGUF_FAMILIES))
def test_a_gguf_of_each_family_gives_its_folders_logits(model_dir, model_type):
    """A tiny model written as a GGUF file (gguf's tensor names for the architecture, the metadata
    keys, gemma's norms as 1 + weight), loaded back into the own forward: its folder's logits."""
    from gguf_writer import write_gguf

    architecture, settings = GGUF_FAMILIES[model_type]
    folder = save_random_model(model_dir / f"gguf-{model_type}", model_type, seed=5, **settings)
    from_folder = load(folder, backend="specdec")
    from_file = load(write_gguf(folder, model_dir / f"{model_type}.gguf", architecture), backend="specdec")
    file_config, folder_config = from_file.network.config, from_folder.network.config
    assert from_file.backend == "specdec" and file_config.rms_norm_eps == pytest.approx(folder_config.rms_norm_eps)
    assert dataclasses.replace(file_config, rms_norm_eps=folder_config.rms_norm_eps) == folder_config  # eps: float32
    tokens = torch.randint(0, from_folder.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(from_file.extend(tokens, from_file.new_cache()),
                               from_folder.extend(tokens, from_folder.new_cache()), atol=0, rtol=0)


def test_a_gguf_whose_architecture_cannot_be_read_says_so_in_one_line(model_dir):
    """transformers' reader has no olmo2: one line naming the architecture and llama.cpp's way."""
    from gguf_writer import write_gguf

    folder = save_family(model_dir / "gguf-olmo2", "olmo2")
    with pytest.raises(ValueError) as raised:
        load(write_gguf(folder, model_dir / "olmo2.gguf", "olmo2"), backend="specdec")
    message = str(raised.value)
    assert "olmo2" in message and "llama.cpp" in message and "\n" not in message


def test_phi4_minis_longrope_and_partial_rotary_run_up_to_the_short_factors_context(model_dir):
    """Phi-4-mini's rope: longrope (short factors up to original_max_position_embeddings) on 3/4
    of each head. The own forward runs it with the context capped there, its logits those of
    transformers, and greedy speculative output in int4 equals target-only."""
    settings = dict(head_dim=8, partial_rotary_factor=0.75, max_position_embeddings=128,
                    original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0],
        "long_factor": [4.0, 5.0, 6.0], "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75})
    folder = save_family(model_dir / "family-phi4-rope", "phi3", **settings)
    lean, reference = load(folder, backend="specdec"), load(folder, backend="transformers")
    assert lean.max_context == 64 and lean.network.config.rotary == 6
    tokens = torch.randint(0, lean.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    cache = lean.new_cache()
    logits = torch.cat([lean.extend(tokens[:25], cache), lean.extend(tokens[25:], cache)])
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=1e-4, rtol=0)
    target = load(folder, quantize="int4")
    assert all(isinstance(layer, FusedDecoderLayer) for layer in target.network.layers)
    prompt = tokens[:12].tolist()
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=20).token_ids
    assert SpeculativeDecoder(target, make_drafter("ngram")).generate(prompt, max_new_tokens=20).token_ids == expected
