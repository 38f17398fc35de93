"""Packed weights on disk (specdec.models.packed_store): a model packed once and read back gives
the same logits and greedy text as packing it in memory, in every precision; a changed weight file
packs anew; a damaged entry is refused and written again; packing streams, so its peak memory is
about the packed model plus one layer, not the float32 model."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_random_model

from specdec import SpeculativeDecoder
from specdec.models import packed_store
from specdec.models.int4 import Int4Linear
from specdec.models.loading import load
from specdec.models.memory import ModelSize, WontFit, check_fits
from specdec.models.precisions import quantize_model
from specdec.models.quantize import Int8Linear
from specdec.models.w8a32 import W8A32Linear

TOKENS = torch.tensor([5, 9, 14, 3, 27, 8, 19, 40, 2, 11])


def logits_of(model) -> torch.Tensor:
    cache = model.new_cache()
    return torch.cat([model.extend(TOKENS[:6], cache), model.extend(TOKENS[6:], cache)])


def greedy(model) -> list[int]:
    return SpeculativeDecoder(model).generate(TOKENS[:4].tolist(), max_new_tokens=24).token_ids


def no_packing(monkeypatch) -> None:
    """Packing refused from here on: a load must read what is stored."""
    for kind in (Int4Linear, W8A32Linear, Int8Linear):
        monkeypatch.setattr(kind, "of", classmethod(lambda cls, *args: pytest.fail(f"{cls.__name__} packed")))


@pytest.mark.parametrize("quantize", ["int4", "w8a32", "int8"])
@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_a_stored_model_reads_back_as_packing_it_in_memory(model_dir, monkeypatch, quantize, model_type):
    folder = save_random_model(model_dir / f"stored-{model_type}-{quantize}", model_type, seed=3)
    in_memory = quantize_model(load(folder).network, quantize)  # the float32 model packed whole, as before
    first = load(folder, quantize=quantize)  # packed layer by layer, and written
    entries = [entry for entry in packed_store.entries() if entry.manifest["source"].startswith(str(folder))]
    assert len(entries) == 1 and entries[0].manifest["quantized"] == first.precision == quantize
    no_packing(monkeypatch)
    second = load(folder, quantize=quantize)
    assert second.network.quantize_notice == first.network.quantize_notice == in_memory.quantize_notice
    assert [type(layer) for layer in second.network.layers] == [type(layer) for layer in in_memory.layers]
    expected = logits_of(first)
    assert torch.equal(logits_of(second), expected)
    first.network = in_memory
    assert torch.equal(logits_of(first), expected)
    assert greedy(second) == greedy(first)


def test_a_changed_weight_file_packs_anew_and_the_old_entry_goes(model_dir):
    folder = save_random_model(model_dir / "changing", "qwen2", seed=4)
    before = logits_of(load(folder, quantize="int4"))
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"] * 2
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    after = load(folder, quantize="int4")
    assert not torch.equal(logits_of(after), before)
    assert torch.equal(logits_of(after), logits_of(load(folder, quantize="int4")))
    assert len([entry for entry in packed_store.entries() if entry.manifest["source"].startswith(str(folder))]) == 1


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing"])
def test_a_damaged_entry_is_refused_and_written_again(model_dir, monkeypatch, damage):
    folder = save_random_model(model_dir / f"damaged-{damage}", "llama", seed=5)
    expected = logits_of(load(folder, quantize="w8a32"))
    entry = next(entry for entry in packed_store.entries() if entry.manifest["source"].startswith(str(folder)))
    layer_file = entry.folder / "layers.1.safetensors"
    data = layer_file.read_bytes()
    if damage == "truncated":
        layer_file.write_bytes(data[: len(data) // 2])
    elif damage == "changed":
        layer_file.write_bytes(data[:-8] + bytes(8 * [0x55]))
    else:
        layer_file.unlink()
    said = []
    monkeypatch.setattr(packed_store, "_stderr_line", said.append)
    monkeypatch.setattr(packed_store, "SAY_FROM_BYTES", 0)
    assert torch.equal(logits_of(load(folder, quantize="w8a32")), expected)
    assert "cannot be used" in said[0] and "packing" in said[0]
    no_packing(monkeypatch)
    assert torch.equal(logits_of(load(folder, quantize="w8a32")), expected)  # written whole again


def test_memory_is_said_before_it_is_needed():
    """A 7B-shaped config: float32 refused with the size and a way that fits; int4 fits 24 GiB."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064)
    size = ModelSize.of(config)
    with pytest.raises(WontFit, match=r"qwen-7b in float32 needs ~3\d\.\d GiB of memory, and 24.0 GiB is "
                                      r"available: --quantize int4 needs ~\d+\.\d GiB"):
        check_fits("qwen-7b", size, None, available=24 << 30)
    check_fits("qwen-7b", size, "int4", packing=True, available=24 << 30)
    with pytest.raises(WontFit, match="no precision fits here"):
        check_fits("qwen-7b", size, "int4", available=2 << 30)


# Run in a fresh process: a test worker's allocator holds what earlier tests freed, which blurs a peak.
PEAK_SCRIPT = """
import gc, sys
from pathlib import Path
from specdec.models import packed_store
from specdec.models.loading import load
packed_store.store_root = lambda: Path(sys.argv[3])
status = Path("/proc/self/status")
def kib(field):
    return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(field))
load(sys.argv[1], quantize="int4")  # imports and kernel checks, on a tiny model
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
before = kib("VmRSS:")
model = load(sys.argv[2], quantize="int4")
tensors = [*model.network.buffers(), *model.network.parameters()]
print((kib("VmHWM:") - before) * 1024, sum(tensor.numel() * tensor.element_size() for tensor in tensors))
"""


def test_packing_streams_layer_by_layer(model_dir, tmp_path):
    """The conversion's peak memory above what the process held: about the packed model and one
    layer's float32 weights (generous margin), well under the float32 model it would once hold."""
    import os
    import subprocess
    import sys

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs here to measure a peak")
    warm_up = save_random_model(model_dir / "warm-up", "qwen2", seed=7)
    folder = save_random_model(model_dir / "streamed", "qwen2", seed=6, hidden_size=512, intermediate_size=2048,
                               num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2)
    float32_bytes = sum(tensor.numel() * 4 for tensor in load_file(str(folder / "model.safetensors")).values())
    # A fixed mmap threshold: glibc would otherwise serve a layer's 8 MB tensors from a heap that only
    # grows (its threshold rises to 32 MB as big blocks are freed), adding its fragments to the peak.
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(warm_up), str(folder), str(tmp_path / "packed")],
                            capture_output=True, text=True, check=True, env=environment)
    peak, packed_bytes = map(int, result.stdout.split())
    layer_bytes = float32_bytes // 24
    # (64 MiB: the allocator's and the runtime's own, measured ~50 MiB; the float32 model is 349 MiB)
    assert peak < packed_bytes + 4 * layer_bytes + (64 << 20) < float32_bytes, (peak, packed_bytes, float32_bytes)


def test_the_cache_command_lists_and_clears_entries(model_dir, capsys):
    from specdec.commands.cli import main

    folder = save_random_model(model_dir / "listed", "llama", seed=8)
    load(folder, quantize="int4")
    assert main(["cache", "list"]) == 0
    listed = capsys.readouterr().out
    assert "listed-int4-" in listed and "int4" in listed
    assert main(["cache", "clear", "listed"]) == 0
    assert "removed 1 packed models" in capsys.readouterr().out
    assert not [entry for entry in packed_store.entries() if "listed" in entry.folder.name]
