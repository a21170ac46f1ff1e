#!/bin/bash
# Interleaved before/after: each merging case, old then new, then scoring cases.
set -u
PY=/work/main/.venv/bin/python
CASES="ta:full tsv:full iso_cts:full ta:core tsv:core ties:core dare:core ta:knots ties:knots ties:core+model"
for c in $CASES; do
  for side in base new; do
    if [ $side = base ]; then dir=/work/base; else dir=/work/new; fi
    tag=${c//:/_}; tag=${tag//+/_}
    (cd $dir && PYTHONPATH=$dir $PY benchmarks/merging.py --only "$c" --repeat 5 --out /work/bench/m_${side}_${tag}.json > /work/bench/m_${side}_${tag}.log 2>&1)
  done
done
for cs in vit qwen; do
  for side in base new; do
    if [ $side = base ]; then dir=/work/base; else dir=/work/new; fi
    (cd $dir && PYTHONPATH=$dir $PY benchmarks/scoring.py --cases $cs --repeats 7 --dense-per-shape 0 --out /work/bench/s_${side}_${cs}.json > /work/bench/s_${side}_${cs}.log 2>&1)
  done
done
echo done > /work/bench/compare.done
