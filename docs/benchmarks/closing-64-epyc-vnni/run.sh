#!/bin/sh
# The suites of issue 62's closing run again after issue 64's changes to auto (cap 16, copies judged whole).
O=docs/benchmarks/closing-64-epyc-vnni exec sh docs/benchmarks/closing-epyc-vnni/run.sh
