"""A Hugging Face folder with a real model's shapes and random weights, written shard by shard
(never the whole model in memory): for loading and memory measurements of models no registry
package ships, such as a 7B on a 24 GB machine.

    python benchmarks/loading/random_checkpoint.py OUT --like FOLDER --set hidden_size=3584 \\
        --set intermediate_size=18944 --set num_attention_heads=28 --set num_key_value_heads=4 \\
        --set vocab_size=152064        # Qwen2.5-7B's shapes, FOLDER's tokenizer and other fields

Weights: normal(0, 0.02) in bfloat16, norms 1; the text it writes is noise, the bytes are real.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", type=Path, required=True, help="a folder whose config and tokenizer to take")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field (JSON value)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = json.loads((args.like / "config.json").read_text())
    for assignment in args.set:
        field, value = assignment.split("=", 1)
        config[field] = json.loads(value)
    config.pop("layer_types", None)  # one per layer of the model it was: transformers derives it again
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (args.like / name).is_file():
            shutil.copy(args.like / name, args.out / name)
    with torch.device("meta"):  # names and shapes only
        shapes = {name: tensor.shape for name, tensor in
                  AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.out)).state_dict().items()}
    generator = torch.Generator().manual_seed(args.seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        file_name = f"model-{shard_index:05d}.safetensors"
        save_file(shard, str(args.out / file_name), metadata={"format": "pt"})
        weight_map.update((name, file_name) for name in shard)
        print(f"{file_name}: {len(shard)} tensors, {shard_bytes / 2**30:.2f} GiB", flush=True)
        shard, shard_bytes, shard_index = {}, 0, shard_index + 1

    for name, shape in shapes.items():
        if "norm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": sum(shapes[name].numel() * 2 for name in weight_map)}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


if __name__ == "__main__":
    main()
