#!/bin/bash
# Target T(1) and T(5) under OpenMP wait settings, on a quiet machine and beside one process
# spinning on a core (docs/llama-cpp.md, "Where the time goes"). From the repository root:
#   benchmarks/real-pair/llamacpp-profile/contention.sh [python]
P=${1:-python}
HERE=$(dirname "$0")
for busy in 0 1; do
  if [ $busy = 1 ]; then $P -c "while True: pass" & BURN=$!; fi
  $P "$HERE/decode_costs.py" busy=$busy
  OMP_WAIT_POLICY=PASSIVE $P "$HERE/decode_costs.py" busy=$busy
  GOMP_SPINCOUNT=1000 $P "$HERE/decode_costs.py" busy=$busy spincount=1000
  if [ $busy = 1 ]; then kill $BURN; fi
done
