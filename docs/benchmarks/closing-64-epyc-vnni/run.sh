#!/bin/sh
# The suites of issue 62's closing run again after issue 64's changes to auto (cap 16, copies judged whole).
M=${M:-/work/models}
L="--llama-cpp-bin /tmp/llamacpp/bin-noamx --target-gguf $M/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
O=docs/benchmarks/closing-64-epyc-vnni
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto llama-target llama-lookup $L --per-category 2 \
  --max-new-tokens 128 --repeats 1 --out $O/bundled
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto llama-target llama-lookup $L --suite editing \
  --limit 8 --max-new-tokens 128 --repeats 1 --out $O/editing
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto --suite humaneval --limit 40 --repeats 1 \
  --out $O/humaneval40
