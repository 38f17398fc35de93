#!/bin/sh
# Issue 62's end-to-end figures on the final code: the real pair with only --target, beside llama.cpp.
M=${M:-/work/models}
L="--llama-cpp-bin /tmp/llamacpp/bin-noamx --target-gguf $M/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
O=${O:-docs/benchmarks/closing-epyc-vnni}
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto llama-target llama-lookup $L --per-category 2 \
  --max-new-tokens 128 --repeats 1 --out $O/bundled
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto llama-target llama-lookup $L --suite editing \
  --limit 8 --max-new-tokens 128 --repeats 1 --out $O/editing
specdec bench --target "$M/qwen2.5-coder-1.5b" --methods auto --suite humaneval --limit 40 --repeats 1 \
  --out $O/humaneval40
