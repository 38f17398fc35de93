#!/usr/bin/env bash
source /work/main/.venv/bin/activate
OUT=/tmp/serve79/ab
for r in 1 2 3; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/before79
    echo "== $r $side $(date +%T)"
    (cd $dir && PYTHONPATH=$dir python -m specdec bench-serve --concurrency 1 2 4 8 16 32 --modes auto --repeats 1 --max-new-tokens 32 --out $OUT/$side-$r) > $OUT/$side-$r.log 2>&1
    echo "   rc $? $(date +%T)"
  done
done
echo finished
