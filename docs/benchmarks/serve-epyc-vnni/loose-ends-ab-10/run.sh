source /work/main/.venv/bin/activate
OUT=/tmp/s5/serve-ab; mkdir -p $OUT
# warm-up: kernels compiled, caches filled (not timed)
for side in before now; do (cd /tmp/s5/$side && PYTHONPATH=/tmp/s5/$side python -m specdec.cli bench-serve --concurrency 1 --modes auto --repeats 1 --max-new-tokens 8 --out $OUT/warm-$side) > $OUT/warm-$side.log 2>&1; echo "warm $side rc $?"; done
for r in 1 2 3 4 5 6 7 8 9 10; do
  if [ $((r % 2)) = 1 ]; then order="before now"; else order="now before"; fi
  for side in $order; do
    echo "== $r $side $(date +%T)"
    (cd /tmp/s5/$side && PYTHONPATH=/tmp/s5/$side python -m specdec.cli bench-serve --concurrency 1 2 4 8 16 32 --modes auto --repeats 1 --max-new-tokens 32 --out $OUT/$side-$r) > $OUT/$side-$r.log 2>&1
    echo "   rc $? $(date +%T)"
  done
done
