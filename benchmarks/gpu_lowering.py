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
TA in KnOTS space (``--llama8b``: Llama-3-8B's shapes, a few layers, TIES in Core space), with the library's GPU SVD route (``_core.linalg.svd``) and with it turned off
(``--lapack-svd``: every SVD through cuSOLVER's, as before the route). No timing: counts only.
Where a ``lax.cond`` chooses between branches (the exact QR: its Gram route, or Householder QR
when that route loses a direction), ``launches`` takes the branch with the fewest and
``launches_most`` the one with the most.

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
import fixed_cost
from _harness import code_info, machine_info, write_json
from fixed_cost import make_adapters

import netutility_jax as nu
from netutility_jax._core import linalg as _linalg

CASES = [("tsv", "core"), ("iso_c", "core"), ("ties", "knots"), ("ta", "knots")]
CASES_8B = [("tsv", "core"), ("iso_c", "core"), ("ties", "core"), ("ta", "knots")]
# Llama-3-8B's module shapes (d_in, d_out), for --llama8b: its QRs take the Gram route (d > 512)
LLAMA3_8B = {
    "q_proj": (4096, 4096),
    "k_proj": (4096, 1024),
    "v_proj": (4096, 1024),
    "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336),
    "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}
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


def _functions(text: str) -> dict[str, str]:
    """Each ``func.func`` of a lowered module by name: its text up to the next one."""
    heads = list(re.finditer(r"func\.func (?:public|private) @(\w+)\(", text))
    return {
        m.group(1): text[m.start() : nxt.start() if nxt else len(text)]
        for m, nxt in zip(heads, [*heads[1:], None], strict=True)
    }


def _top_cases(body: str) -> list[tuple[int, int, list[str]]]:
    """``(start, end, branches)`` of each ``stablehlo.case`` (a ``lax.cond`` or ``switch``) of
    ``body`` not nested in another: its span and each branch's text."""
    out = []
    for m in re.finditer(r'"stablehlo\.case"\([^)]*\) \(', body):
        if out and m.start() < out[-1][1]:
            continue  # nested: its own branch's cost counts it
        depth, i, branches, at = 1, m.end(), [], None
        braces = 0
        while depth and i < len(body):
            ch = body[i]
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "{":
                braces += 1
                if braces == 1:
                    at = i + 1
            elif ch == "}":
                braces -= 1
                if braces == 0:
                    branches.append(body[at:i])
            i += 1
        out.append((m.start(), i, branches))
    return out


def launch_range(text: str) -> tuple[collections.Counter, collections.Counter, list[str]]:
    """The solver launches of ``main`` of a lowered module, per kernel: ``(fewest, most)`` over
    the branches a ``lax.cond`` may take (the exact QR's Householder fallback runs only when
    the Gram route loses a direction; its Gram route is the branch with the fewest), and every
    call as ``target shape``."""
    bodies = _functions(text)
    listed = []
    for m in _CALL.finditer(text):
        listed.append(f"{m.group(1)} {m.group(2)}")
    memo: dict[str, tuple[collections.Counter, collections.Counter]] = {}

    def region(body: str) -> tuple[collections.Counter, collections.Counter]:
        lo, hi = collections.Counter(), collections.Counter()
        cases = _top_cases(body)
        outside = lambda pos: not any(a <= pos < b for a, b, _ in cases)
        for m in _CALL.finditer(body):
            if outside(m.start()):
                shape = tuple(int(d) for d in m.group(2).split("x"))
                kernel = m.group(1).replace("cusolver_", "").replace("_ffi", "")
                n = launches(m.group(1), shape)
                lo[kernel] += n
                hi[kernel] += n
        for c in re.finditer(r"call @(\w+)\(", body):
            if outside(c.start()) and c.group(1) in bodies:
                a, b = function(c.group(1))
                lo.update(a)
                hi.update(b)
        for _, _, branches in cases:
            costs = [region(br) for br in branches]
            if costs:
                lo.update(min((c[0] for c in costs), key=lambda x: sum(x.values())))
                hi.update(max((c[1] for c in costs), key=lambda x: sum(x.values())))
        return lo, hi

    def function(name: str) -> tuple[collections.Counter, collections.Counter]:
        if name not in memo:
            memo[name] = (collections.Counter(), collections.Counter())  # (no recursion)
            memo[name] = region(bodies[name])
        return memo[name]

    lo, hi = function("main")
    return lo, hi, listed


def _while_spans(body: str) -> list[tuple[int, int]]:
    """The text spans of every ``stablehlo.while`` (its ``cond`` and ``do`` blocks) in ``body``."""
    spans = []
    for m in re.finditer(r"stablehlo\.while\(", body):
        i, depth, blocks = body.index("{", m.end()), 0, 0
        while blocks < 2 and i < len(body):
            depth += {"{": 1, "}": -1}.get(body[i], 0)
            if body[i] == "}" and depth == 0:
                blocks += 1
            i += 1
        spans.append((m.start(), i))
    return spans


def solver_calls_in_loops(text: str) -> int:
    """Solver custom calls that sit in a ``while`` loop's body, or in a function called there
    (each would run once per iteration; the launch counts assume none)."""
    bodies = _functions(text)
    memo: dict[str, int] = {}

    def solvers(name: str) -> int:  # solver calls a function makes, through its callees
        if name not in memo:
            memo[name] = 0
            body = bodies[name]
            memo[name] = len(_CALL.findall(body)) + sum(
                solvers(c) for c in re.findall(r"call @(\w+)\(", body) if c in bodies
            )
        return memo[name]

    count = 0
    for body in bodies.values():
        for a, b in _while_spans(body):
            inner = body[a:b]
            count += len(_CALL.findall(inner))
            count += sum(solvers(c) for c in re.findall(r"call @(\w+)\(", inner) if c in bodies)
    return count


def lowered(method: str, space: str, layers: int) -> str:
    stacked = nu.stack_adapters(make_adapters(layers, 8, 16))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacked)

    def merged(a):
        return nu.merge_adapters(a, budget=16, method=method, space=space)[0]

    return export.export(jax.jit(merged), platforms=["cuda"])(abstract).mlir_module()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="32,80")
    p.add_argument("--lapack-svd", action="store_true", help="the GPU SVD route off (before)")
    p.add_argument("--llama8b", action="store_true", help="Llama-3-8B's shapes (use --depths 2,4)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.llama8b:
        fixed_cost.KINDS = LLAMA3_8B  # (make_adapters reads it)
    if a.lapack_svd:
        _linalg._GPU_BATCHED_SVD = 1 << 30  # every SVD through jnp.linalg.svd
    rows = []
    # (TIES in KnOTS space at 8B's shapes merges its 14336-row modules in row blocks, which do
    # not run under jax.jit: Core space there)
    for method, space in CASES_8B if a.llama8b else CASES:
        for layers in (int(d) for d in a.depths.split(",")):
            text = lowered(method, space, layers)
            lo, hi, calls = launch_range(text)
            row = {
                "method": method,
                "space": space,
                "layers": layers,
                "modules": layers * len(fixed_cost.KINDS),
                "solver_calls": len(calls),
                "launches": sum(lo.values()),
                "launches_by_kernel": dict(sorted(lo.items())),
                "launches_most": sum(hi.values()),
                "launches_most_by_kernel": dict(sorted(hi.items())),
                "calls": calls,
                "while_loops": text.count("stablehlo.while"),
                "solver_calls_in_loops": solver_calls_in_loops(text),
            }
            rows.append(row)
            print(f"{method}-{space} {layers} layers: {row['solver_calls']} solver calls, "
                  f"{row['launches']} launches {row['launches_by_kernel']} (at most "
                  f"{row['launches_most']} {row['launches_most_by_kernel']})")  # fmt: skip
    name = (
        "gpu_lowering" + ("_llama8b" if a.llama8b else "") + ("_lapack_svd" if a.lapack_svd else "")
    )
    name += ".json"
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    write_json(out, {"benchmark": "gpu_lowering", "machine": machine_info(), "code": code_info(),
                     "argv": sys.argv[1:], "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
