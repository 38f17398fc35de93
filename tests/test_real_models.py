"""The fetched real pair (../shared/real-models/fetch.sh DIR), when SPECDEC_REAL_MODELS=DIR is set:
skipped otherwise (CI does not fetch them). Run: SPECDEC_REAL_MODELS=DIR pytest -m real_models."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(os.environ["SPECDEC_REAL_MODELS"]) if os.environ.get("SPECDEC_REAL_MODELS") else None
pytestmark = [pytest.mark.real_models,
              pytest.mark.skipif(ROOT is None, reason="set SPECDEC_REAL_MODELS to the folder fetch.sh wrote")]
PROMPTS = ["def quicksort(items):", "class LRUCache:\n    def __init__(self, capacity):",
           "# Read a CSV file and print the mean of each column\nimport csv\n"]


def test_gguf_dequantized_gives_the_converted_folders_logits():
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from specdec import load

    # fetch.sh converted the same GGUF and saved it in bfloat16: in bfloat16 the weights, and so
    # the logits, must be identical.
    folder = load(ROOT / "qwen2.5-coder-0.5b", dtype="bfloat16")
    from_gguf = load(ROOT / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf", backend="specdec", dtype="bfloat16")
    ids = torch.tensor(folder.tokenizer.encode(PROMPTS[1]))
    assert from_gguf.tokenizer.encode(PROMPTS[1]) == ids.tolist()
    assert torch.equal(folder.extend(ids, folder.new_cache()), from_gguf.extend(ids, from_gguf.new_cache()))


def test_int8_speculation_equals_target_only_on_the_real_pair():
    from specdec import SpeculativeDecoder, load, make_drafter

    target = load(ROOT / "qwen2.5-coder-1.5b", quantize="int8")
    draft = load(ROOT / "qwen2.5-coder-0.5b", quantize="int8")
    expected = SpeculativeDecoder(target).generate(PROMPTS, max_new_tokens=32)
    for drafter in (make_drafter("model", draft), make_drafter("ngram")):
        got = SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPTS, max_new_tokens=32)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
