# bench-serve before (9c3a50b) vs now (main), alternated, ROUNDS rounds
source $MAIN/.venv/bin/activate
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-serve-ab}
mkdir -p $OUT
for r in $(seq 1 $ROUNDS); do
  for side in before main; do
    dir=$MAIN; [ $side = before ] && dir=$BEFORE
    echo "== $r $side $(date +%T)"
    (cd $dir && PYTHONPATH=$dir python -m specdec.cli bench-serve --concurrency 1 2 4 8 16 32 --modes auto --repeats 1 --max-new-tokens 32 --out $OUT/$side-$r) > $OUT/$side-$r.log 2>&1
    echo "   rc $? $(date +%T)"
  done
done
