#!/bin/bash
# Seconds from `specdec serve ARGS` to the first 200 from /health. Usage: serve_startup.sh PORT ARGS...
PORT=$1; shift
start=$(date +%s.%N)
specdec serve --port $PORT "$@" > /tmp/serve-$PORT.log 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  sleep 0.2
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -5 /tmp/serve-$PORT.log; exit 1; fi
done
end=$(date +%s.%N)
echo "ready in $(echo "$end - $start" | bc) s: specdec serve $*"
kill $pid; wait $pid 2>/dev/null
