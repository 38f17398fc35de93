"""What the corpus drafter costs and finds, with a target's tokenizer and no model: the default
datastore's build (time, disk, memory; built here if not cached), then every position of the
bundled suite's prompts looked up as a step would (``propose`` with the context so far): the
seconds per lookup, and how often the draft's first token is the prompt's next one (a rough
acceptance on text the datastore never saw: files quoting the suites are left out of it).

    python benchmarks/corpus_lookup_cost.py /work/models/qwen2.5-coder-1.5b [--limit 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.bench.runner import peak_rss_mb
from specdec.commands.index import load_tokenizer
from specdec.core.drafts import ContextRequest
from specdec.corpus_index import default_datastore
from specdec.defaults import default_prompts
from specdec.drafting.corpus import CorpusDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a Hugging Face folder or a .gguf file (only its tokenizer loads)")
    parser.add_argument("--limit", type=int, default=16, help="prompts of the bundled suite to walk through")
    parser.add_argument("--gamma", type=int, default=12, help="draft length asked of each lookup (auto's cap)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target, trust_remote_code=False)
    began = time.perf_counter()
    store = default_datastore(tokenizer, print)
    print(f"default datastore: {store.folder}, {store.meta['tokens']:,} tokens of {store.meta['documents']:,} files, "
          f"built in {store.meta['build_seconds']:.1f} s, {store.disk_bytes / 2**20:.1f} MiB on disk; ready in "
          f"{time.perf_counter() - began:.1f} s here, peak memory {peak_rss_mb():.0f} MiB")
    drafter = CorpusDrafter([store])
    prompts = [item["prompt"] for item in json.loads(default_prompts().read_text())][: args.limit]
    seconds, drafted, first_right, tokens = [], 0, 0, 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        for end in range(1, len(ids)):
            request = ContextRequest(torch.tensor(ids[:end]))
            started = time.perf_counter()
            draft = drafter.propose(request, args.gamma)
            seconds.append(time.perf_counter() - started)
            tokens += 1
            if draft.num_nodes:
                drafted += 1
                first_right += int(draft.tokens[0]) == ids[end]
    print(f"{len(seconds)} lookups over {len(prompts)} bundled prompts: median "
          f"{statistics.median(seconds) * 1e6:.0f} us, mean {statistics.fmean(seconds) * 1e6:.0f} us, 90th percentile "
          f"{sorted(seconds)[int(0.9 * len(seconds))] * 1e6:.0f} us; a draft at {drafted / tokens:.0%} of positions, "
          f"its first token right at {first_right / max(drafted, 1):.0%} of those")


if __name__ == "__main__":
    main()
