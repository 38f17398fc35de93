"""Bad input gets a clear error that names the problem."""

import json

import pytest
from tiny import save_random_model

from specdec import SpeculativeDecoder, load


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load(tiny_pair["target"])


def test_vocabulary_mismatch_names_both_sizes(target, model_dir):
    # Without a tokenizer the draft cannot be translated (with one it would be: test_translate.py).
    other = load(save_random_model(model_dir / "vocab-64", "llama", vocab_size=64, tokenizer=False))
    with pytest.raises(ValueError, match=r"vocabularies differ.*64.*96"):
        SpeculativeDecoder(target, other)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(target, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        SpeculativeDecoder(target).generate(prompt)


@pytest.mark.parametrize("max_new_tokens", [0, -3])
def test_non_positive_max_new_tokens(target, max_new_tokens):
    with pytest.raises(ValueError, match=f"max_new_tokens must be positive, got {max_new_tokens}"):
        SpeculativeDecoder(target).generate([1, 2], max_new_tokens=max_new_tokens)


def test_prompt_longer_than_context(target):
    with pytest.raises(ValueError, match=r"prompt has 200 tokens but the context holds 128"):
        SpeculativeDecoder(target).generate([5] * 200)


def test_generation_stops_at_the_context_length(target):
    result = SpeculativeDecoder(target, target, gamma=8).generate([5] * 120, max_new_tokens=50)
    assert len(result.prompt_ids) + len(result.token_ids) <= 128
    assert result.finish_reason in ("context", "eos")


def test_token_ids_outside_vocabulary(target):
    with pytest.raises(ValueError, match=r"outside the vocabulary \(0..95\)"):
        SpeculativeDecoder(target).generate([3, 500])


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unknown model_type 'frobnicator'"):
        load(tmp_path)


def test_custom_code_needs_opt_in(tmp_path):
    config = {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load(tmp_path)


def test_unknown_dtype_and_quantization(tiny_pair):
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        load(tiny_pair["target"], dtype="int4")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load(tiny_pair["target"], quantize="int3")


def test_negative_gamma(target):
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        SpeculativeDecoder(target, target, gamma=-1)


def test_unsupported_architecture_uses_the_adapter(model_dir):
    """gpt2 is not in the lean forward: auto loads it through transformers, and it decodes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = model_dir / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(folder)
    model = load(folder)
    assert model.backend == "transformers"
    with pytest.raises(ValueError, match="cannot run this model"):
        load(folder, backend="specdec")
    plain = SpeculativeDecoder(model).generate([1, 2, 3], max_new_tokens=10)
    speculative = SpeculativeDecoder(model, load(folder), gamma=3).generate([1, 2, 3], max_new_tokens=10)
    assert speculative.token_ids == plain.token_ids and len(plain.token_ids) > 0


def cli_error(argv, capsys) -> str:
    from specdec.commands.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return " ".join(err.split())  # rich wraps long lines


def test_ordinary_mistakes_are_one_line_errors(tiny_pair, tmp_path, capsys):
    import shutil

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_pair["target"], truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "not a readable safetensors file" in cli_error(["generate", "--target", str(truncated), "hi"], capsys)
    assert "unknown device 'tpu'" in cli_error(["generate", "--target", str(tiny_pair["target"]), "--device", "tpu",
                                                "hi"], capsys)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_pair["target"], corrupt)
    (corrupt / "config.json").write_text("{not json")
    message = cli_error(["generate", "--target", str(corrupt), "hi"], capsys)
    assert "config.json is not valid JSON" in message and str(corrupt) in message
    empty_file = tmp_path / "model.bin"
    empty_file.write_bytes(b"")
    assert "is a file, not a model folder" in cli_error(["generate", "--target", str(empty_file), "hi"], capsys)
    wrong_type = tmp_path / "wrong-type"
    shutil.copytree(tiny_pair["target"], wrong_type)
    config = json.loads((wrong_type / "config.json").read_text())
    (wrong_type / "config.json").write_text(json.dumps({**config, "hidden_size": "banana"}))
    message = cli_error(["generate", "--target", str(wrong_type), "hi"], capsys)
    assert str(wrong_type / "config.json") in message and "hidden_size" in message
    bad_tokenizer = tmp_path / "bad-tokenizer"
    shutil.copytree(tiny_pair["target"], bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    message = cli_error(["generate", "--target", str(bad_tokenizer), "hi"], capsys)
    assert str(bad_tokenizer / "tokenizer.json") in message and "is not valid JSON" in message
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert "is not UTF-8 text" in cli_error(["generate", "--target", str(tiny_pair["target"]), "--prompt-file",
                                             str(latin)], capsys)


def test_ctrl_c_is_a_message_not_a_traceback(tiny_pair, capsys, monkeypatch):
    from specdec.commands import generate as generate_command
    from specdec.commands.cli import main

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_command, "run", interrupted)
    assert main(["generate", "--target", str(tiny_pair["target"]), "hi"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_a_hub_id_resolves_through_huggingface_hub(tiny_pair, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_download(repo_id, allow_patterns=None):
        asked.append((repo_id, allow_patterns))
        return str(tiny_pair["target"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model = load("some-org/tiny-llama")
    assert asked[0][0] == "some-org/tiny-llama" and "config.json" in asked[0][1]
    assert model.vocab_size == load(tiny_pair["target"]).vocab_size

    def offline(repo_id, allow_patterns=None):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="some-org/tiny-llama is not a local folder.*offline"):
        load("some-org/tiny-llama")
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load("./missing/folder")  # a path, not a Hub id: no download is tried


def test_every_named_end_token_stops_generation(tiny_pair, tmp_path):
    import shutil

    folder = tmp_path / "eos"
    shutil.copytree(tiny_pair["target"], folder)
    config = json.loads((folder / "config.json").read_text())
    greedy = SpeculativeDecoder(load(folder)).generate([5, 6, 7], max_new_tokens=12).token_ids
    # Name the 4th greedy token an end token in generation_config.json only (as Instruct models
    # name their end-of-turn token): generation must stop there.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[3]]}))
    model = load(folder)
    assert greedy[3] in model.eos_token_ids
    if config.get("eos_token_id") is not None:
        assert int(config["eos_token_id"]) in model.eos_token_ids  # the config's own stays
    result = SpeculativeDecoder(model).generate([5, 6, 7], max_new_tokens=12)
    first = greedy.index(greedy[3])
    assert result.finish_reason == "eos" and result.token_ids == greedy[: first + 1]
