"""The solver calls a merge makes on a CUDA GPU, counted without one.

JAX lowers a program for a platform it does not have (``jax.export`` with ``platforms=["cuda"]``),
so the CUDA program of a jitted ``nu.merge_adapters`` can be read on a CPU machine: every
cuSOLVER custom call with its operand's batch and matrix shape. How many solver launches each
call makes follows from jaxlib's GPU kernels (``jaxlib/gpu/solver_kernels_ffi.cc``, jax
0.10-0.11, read, not measured):

* ``gesvdj`` (SVD): one batched launch when both sides are at most 32 (and not thin), else one
  launch per matrix;
* ``orgqr`` (Householder Q): one batched kernel up to 128 x 128, else one per matrix;
* ``geqrf`` (Householder R): cuBLAS's batched kernel for a batch of more than one;
* ``syevd`` (eigh): one batched launch (batched Jacobi up to 32 x 32, ``syevBatched`` above,
  CUDA 12.6.2 and later; older CUDA loops);
* ``potrf`` (Cholesky): batched for a batch of more than one.

Cases: the fixed-cost sets (benchmarks/fixed_cost.py: the seven Llama module kinds, 8 tasks,
r 16, tiny dimensions, stacked) at 32 and 80 layers, for TSV and Iso-C in Core space and TIES and
TA in KnOTS space, with the library's GPU SVD route (``_core.linalg.svd``) and with it turned off
(``--lapack-svd``: every SVD through cuSOLVER's, as before the route). No timing: counts only.

    python benchmarks/gpu_lowering.py                  # JSON to benchmarks/results/
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys

import jax
from jax import export

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import code_info, machine_info, write_json
from fixed_cost import make_adapters

import netutility_jax as nu
from netutility_jax._core import linalg as _linalg

CASES = [("tsv", "core"), ("iso_c", "core"), ("ties", "knots"), ("ta", "knots")]
_CALL = re.compile(r"custom_call @(\w+)\([^)]*\)[^\n]*?: \(tensor<([0-9x]+)x\w+>")


def launches(target: str, shape: tuple[int, ...]) -> int:
    """Solver launches of one custom call on CUDA (the module docstring's rules)."""
    batch = math.prod(shape[:-2])
    m, n = shape[-2:]
    if "gesvdj" in target:
        return 1 if batch > 1 and max(m, n) <= 32 else batch
    if "orgqr" in target:
        return 1 if batch > 1 and max(m, n) <= 128 else batch
    return 1  # geqrf, syevd, potrf, trsm: batched


def solver_calls(method: str, space: str, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    stacked = nu.stack_adapters(make_adapters(layers, 8, 16))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacked)

    def merged(a):
        return nu.merge_adapters(a, budget=16, method=method, space=space)[0]

    text = export.export(jax.jit(merged), platforms=["cuda"])(abstract).mlir_module()
    return [
        (m.group(1), tuple(int(d) for d in m.group(2).split("x"))) for m in _CALL.finditer(text)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="32,80")
    p.add_argument("--lapack-svd", action="store_true", help="the GPU SVD route off (before)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.lapack_svd:
        _linalg._GPU_BATCHED_SVD = 1 << 30  # every SVD through jnp.linalg.svd
    rows = []
    for method, space in CASES:
        for layers in (int(d) for d in a.depths.split(",")):
            calls = solver_calls(method, space, layers)
            by_target = collections.Counter()
            for target, shape in calls:
                by_target[target.replace("cusolver_", "").replace("_ffi", "")] += launches(
                    target, shape
                )
            row = {
                "method": method,
                "space": space,
                "layers": layers,
                "modules": layers * 7,
                "solver_calls": len(calls),
                "launches": sum(by_target.values()),
                "launches_by_kernel": dict(sorted(by_target.items())),
                "calls": [f"{t} {'x'.join(map(str, s))}" for t, s in calls],
            }
            rows.append(row)
            print(f"{method}-{space} {layers} layers: {row['solver_calls']} solver calls, "
                  f"{row['launches']} launches {row['launches_by_kernel']}")  # fmt: skip
    name = "gpu_lowering_lapack_svd.json" if a.lapack_svd else "gpu_lowering.json"
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    write_json(out, {"benchmark": "gpu_lowering", "machine": machine_info(), "code": code_info(),
                     "argv": sys.argv[1:], "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
