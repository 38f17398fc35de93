#!/bin/sh
# Whole-file answers: the real pair with only --target, 2048 new tokens (every answer ends first).
M=${M:-/work/models}
specdec bench --target "$M/qwen2.5-coder-1.5b" --suite predicted-edits --limit 5 --max-new-tokens 2048 \
  --repeats 1 --methods auto auto@noprediction auto@unrelated llama-target llama-lookup llama-server-spec \
  --llama-cpp-bin /tmp/llamacpp/bin-noamx --target-gguf "$M/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
  --out docs/benchmarks/predicted-edits-epyc-vnni/real-whole
