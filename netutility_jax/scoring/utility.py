"""Net Utility of every singular direction of every task's LoRA update (paper Eq. net-utility).

The pipeline is bucketed: modules of equal ``(d_in, d_out, r_max)`` are stacked and scored by one
batched kernel (:func:`score_buckets`), which reads each factor once, through two Grams:

* ``G = X^T X`` with ``X = [a_1 ... a_M]`` the task-stacked input factors ``(d_in, M r)``;
* ``H_i = b_i b_i^T`` per task ``(r, r)``.

Everything after that is ``(M r)``-sized: with ``H_i = R_i^T R_i`` (``R_i^T = F Phi^(1/2)`` from
``eigh(H_i)``), task i's squared singular values and right vectors ``Z_i`` come from the ``r x r``
eigenproblem of ``scale_i^2 R_i G_ii R_i^T``; its input directions are ``in_dirs_i = a_i T_i`` with
``T_i = scale_i R_i^T Z_i S_i^-1``, so every cross-task overlap is ``in_dirs_j^T in_dirs_i =
T_j^T G_ji T_i``. No d-sized QR, no inverse of ``G``; ``S^-1`` is applied to candidates only.

Precision: Gram routes square the conditioning, so a singular value ``s_k`` carries an absolute error
near ``eps * s_max^2 / s_k``. Directions with ``s_k <= rtol * s_max`` of their own task-module are
not candidates; the default ``rtol = sqrt(10 * r_max * eps)`` (4.4e-3 in float32 at r = 16,
2e-7 in float64) sits above that noise. Such directions carry less than ``rtol^2`` of the task's
energy. Enable x64 and pass float64 factors for a tighter cut, or set ``rtol``.

Scale safety: before the Grams, each task-module's ``lora_a``, ``lora_b`` and ``scale`` are divided
by powers of two (exact) so that their largest entries are in ``[0.5, 1)``; the Grams and every
``(M r)``-sized step then see numbers of order one, whatever ``lora_alpha`` or the factors' size.
The update's size is carried as an integer exponent ``E_i`` per task-module (``s = s' 2^E_i``).
Benefits and overlaps are free of it; the interference, which mixes tasks as ``(s_jk / s_max_i)^2``,
gets its power of two ``2^(2 (E_j - E_i))`` exactly, term by term. So the result equals a float64
computation of the same input to float32 rounding, for any scale, as long as every returned
quantity (sigma, interference, utility, lambda) is itself a normal float32 number; where one is not
(for example one task 1e20 times larger than another: its interference is 1e40), :func:`score`
refuses with :class:`InputError` instead of returning zeros, infinities or NaN.

Data-aware geometry (``score(..., input_moments=...)``, docs/input_moments.md): one more
``d``-sized product per task-module, ``a^T S a = (F a)^T (F a)`` from the input-moment factor ``F``
(:func:`moment_grams`), in the same bucketed kernel; then ``C_i = T_i^T (a^T S a) T_i`` is
``(M r)``-sized like the rest. Without moments the kernel is the data-free one, unchanged.

References:
  Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks": Eq.
  net-utility (alpha = 1), App. A.4 (alpha = 0), Hyperparameters (lambda, h).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import check_bool
from .._core.host import host_constant as host_constant
from .._core.host import put_views as put_views
from .._core.linalg import eigh_batched as eigh_batched
from .._core.linalg import mul_pow2
from ..errors import InputError
from . import moments
from ._errors import X64_HINT, range_text
from ._grams import ROUTES as ROUTES
from ._kernels import INTERFERENCES as INTERFERENCES
from ._kernels import BucketStats as BucketStats
from ._kernels import ModuleScores as ModuleScores
from ._kernels import Scores as Scores
from ._kernels import default_rtol as default_rtol
from ._kernels import lam_auto as lam_auto
from ._kernels import score_buckets as score_buckets
from ._kernels import unstack as unstack
from ._run import (
    H_THRESHOLD,
    check_interference,
    check_options,
    log_energies,
    log_energy_variance,
    score_run,
)

__all__ = [
    "INTERFERENCES",
    "ROUTES",
    "BucketStats",
    "ModuleScores",
    "Scores",
    "default_rtol",
    "heterogeneity",
    "lam_auto",
    "score",
    "score_buckets",
    "task_energies",
    "unstack",
]


def score(
    adapters: Sequence[Any],
    *,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    rtol: float | None = None,
    h_threshold: float = H_THRESHOLD,
    checked: bool = False,
    mesh: Any = None,
    input_moments: Sequence[Mapping[str, moments.InputMoments | None] | None] | None = None,
    interference: str = "overlap",
) -> Scores:
    """Net utility of every singular direction of every module and task (paper Eq. net-utility).

    For task ``j``'s k-th direction of a module, with singular values ``s`` and input-side
    directions ``v`` (``in_dirs``)::

        w_j          = sum_n s_jn^(2+2a)
        benefit      = s_jk^(2+2a) / w_j
        interference = s_jk^2 sum_{i!=j} sum_n s_in^(2a) / w_i (v_jk . v_in)^2
        utility      = benefit - lam * interference

    ``a = 1`` is the Gram geometry ``G_i ~ V_i S_i^2 V_i^T`` (paper Eq. gram-geometry), ``a = 0`` the
    row-space heuristic (App. A.4).

    **Data-aware geometry** (``input_moments``; ours, not the paper's, see
    docs/input_moments.md). The paper weighs task ``i``'s error by ``G_i = E_{x~p_i}[x x^T]``
    and, having no data, replaces it by ``M_i M_i`` with ``M_i = V_i Sigma_i^a V_i^T``: the second
    moment of white inputs read through the adapter. Given an estimate ``S_i`` of task ``i``'s
    input second moment, we use ``G_i = M_i S_i M_i`` (task i's real inputs read through its
    adapter). With ``C_i = V_i^T S_i V_i`` (``r_i x r_i``, from ``S_i``'s factor, never
    ``d_in x d_in``), the paper's derivation (same-task components stay orthogonal under any
    ``G``; each task normalised by its own energy) gives::

        W_j          = sum_n s_jn^(2+2a) C_j[n,n]      (= ||dW_j||^2 under G_j)
        benefit      = s_jk^(2+2a) C_j[k,k] / W_j
        interference = s_jk^2 sum_{i!=j} y^T C_i y / W_i,   y_m = s_im^a (v_jk . v_im)

    ``S_i = I`` gives ``C_i = I`` and the data-free score exactly; any positive scale of ``S_i``
    cancels (as the paper's ``kappa_i``), so activations need not be normalised. The part of
    ``S_i`` outside task i's row space does not count: the geometry keeps the proxy's support.

    **Sign-aware interference** (``interference="signed"``; ours, not the paper's, see
    docs/math.md). Two rank-1 components ``c_jk = s_jk u_jk v_jk^T`` and ``c_im`` interact
    through their Frobenius inner product ``<c_jk, c_im>_F = s_jk s_im (u_jk . u_im)(v_jk .
    v_im)``: negative, they cancel in a sum (conflict); positive, they add (agreement). The
    signed term keeps the paper's normalisation and replaces the input overlap ``v_jk . v_im`` by
    the conflicting part of the rank-1 cosine, ``kappa = min(0, (u_jk . u_im)(v_jk . v_im))``::

        interference = s_jk^2 sum_{i!=j} sum_m s_im^(2a) / w_i kappa^2
                     = sum_{i!=j} sum_m min(0, <c_jk, c_im>_F)^2 / w_i        (a = 1)

    so agreeing components add none, and ``|kappa| <= |v_jk . v_im|`` makes it at most the
    paper's term. With ``input_moments``, ``y_m = s_im^a kappa`` in the data-aware formula.
    ``lam="auto"`` is the same median ratio over these values. ``interference="signed_weaker"``
    (ours too) is its asymmetric form: task i's component ``m`` counts in the interference of
    ``(j, k)`` only where ``benefit_jk <= benefit_im``, so of a conflicting pair the direction
    with the smaller share of its own task's energy is charged, and both on a tie.

    All modules of equal shape are scored by one jitted, batched kernel from the Grams of the factors (see the module docstring); no dense update is formed.
    The kernel is scale-safe: factors and scales are normalised by exact powers of two, so any
    finite scale (``lora_alpha`` 1e-30 .. 1e30) gives the float64 result to float32 rounding,
    or an :class:`InputError` where a returned quantity does not fit the compute dtype.

    Checks: on concrete inputs (an ordinary call), every factor and scale must be finite and every
    returned sigma, interference, utility and lambda representable; otherwise
    :class:`InputError` names the module, the task and the array. Under a trace (inside
    ``jax.jit``, ``vmap``...) values are abstract and these checks are skipped: a module with a
    NaN/Inf input gets NaN scores (and ``lam="auto"`` is NaN), an unrepresentable quantity is
    ``inf`` or 0. To have them reported inside ``jit``, pass ``checked=True`` and wrap the
    function in :func:`jax.experimental.checkify.checkify`, which returns the error (``err.get()``
    is the message; ``err.throw()`` raises it). Modules are then named by their position in the
    adapters' module order.

    Args:
      adapters: sequence of M adapter pytrees (one per task) with the same module names. A module
        is ``{"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": ()}`` (scale optional, default
        1, a real number); ranks may differ between tasks and modules (0 too: no candidates).
        ``None`` marks a module a task lacks.
      alpha: geometry exponent, a finite number ``>= 0``; ``"auto"`` applies the paper's
        heterogeneity rule: 0 when ``nu.heterogeneity(adapters) > h_threshold``, else 1.
      lam: interference weight, a finite number ``>= 0``, or ``"auto"``: median benefit / median
        interference over all candidates of all modules (paper, Hyperparameters).
      rtol: relative singular-value cut for candidates, ``0 <= rtol < 1``; default
        ``sqrt(10 * r_max * eps)``.
      h_threshold: finite threshold of the ``alpha="auto"`` rule (between the paper's NLI
        h = 0.63 and vision h = 1.83).
      checked: under a trace, emit :mod:`jax.experimental.checkify` checks for the conditions the
        eager call raises on (the caller must functionalize them with ``checkify.checkify``).
        Ignored on concrete inputs, which are always checked.
      mesh: a one-axis :class:`jax.sharding.Mesh` (:func:`nu.module_mesh`) to shard each
        bucket's modules over its devices (see :mod:`netutility_jax._core.mesh`); None: one device.
        The scores are those of one device. Concrete inputs only.
      input_moments: None (the data-free score), or one entry per task: None (data-free for
        that task), or ``{module name: InputMoments | None}`` from :func:`nu.input_moments`
        (activations) or :func:`nu.input_moments_dense`, naming every module the task has (None:
        data-free there). Mixing is explicit: a module left out is an error. Each ``factor`` is
        ``(k, d_in)`` with ``S = factor^T factor``; cost ``O(k d_in r)`` per task-module. The
        ``alpha="auto"`` rule and ``lam="auto"`` (the median ratio, over the data-aware
        benefits and interferences) apply unchanged.
      interference: ``"overlap"`` (default): the paper's term, from the input directions'
        overlaps (sign-blind); ``"signed"``: only conflicting components count (above; this
        project's extension); ``"signed_weaker"``: each conflict charged to its weaker side
        (above; ours). Static: each value compiles its own kernel.

    Returns:
      :class:`Scores` with ``modules[name]`` fields ``sigma``, ``benefit``, ``interference``,
      ``utility``, each ``(M, r_max)``. A task whose update is zero in a module (or that lacks it,
      or has rank 0 there) has no candidates there and adds no interference. Non-candidates:
      ``sigma = 0``, ``utility = -inf``. With no candidate anywhere and a numeric ``lam``, every
      utility is ``-inf`` (:func:`nu.allocate` then keeps nothing).

    Raises:
      InputError: (a ``ValueError``) empty list, module names or shapes that differ between tasks,
        factors that do not chain, NaN/Inf in a factor or scale (the message names the module,
        task, array and how many entries), a result beyond the compute dtype's range (tasks
        whose update sizes differ by ~1e19 or more in float32), alpha or lam negative or not
        finite, an unknown string option (``interference`` included), rtol outside ``[0, 1)``,
        ``lam="auto"`` with no
        candidate at all; ``input_moments`` with the wrong number of tasks, a module missing or
        unknown, a factor of the wrong ``d_in``, NaN/Inf or all zero, or a task-module update
        that is zero on all of its inputs.
      InputTypeError: (a ``TypeError``) non-floating factors, a scale that is not a real number
        (e.g. the string ``"2.0"``), an option of the wrong type (alpha/lam/rtol/h_threshold not
        a real number, checked not a bool).

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}}
      ...        for _ in range(3)]
      >>> sc = nu.score(ads)
      >>> sc.modules["q"].utility.shape
      (3, 4)
      >>> bool(np.allclose(sc.modules["q"].benefit.sum(1), 1.0, atol=1e-5))
      True
      >>> big = [{"q": {**ad["q"], "scale": 1e30}} for ad in ads]  # sigma ~1e31: scale-safe
      >>> bool(np.allclose(nu.score(big).modules["q"].utility, sc.modules["q"].utility, atol=1e-5))
      True
    """
    fn = "nu.score"
    checked = check_bool(fn, "checked", checked)
    check_options(fn, alpha, lam, rtol, h_threshold)
    interference = check_interference(fn, interference)
    if isinstance(alpha, str):
        h = heterogeneity(adapters, checked=checked, _fn=fn, _for_alpha=True)
        if isinstance(h, jax.core.Tracer):  # under a trace the rule is data, not a branch
            alpha = jnp.where(h > h_threshold, 0.0, 1.0)
        else:
            alpha = 0.0 if float(h) > float(h_threshold) else 1.0
    run = score_run(
        fn, adapters, (alpha,), lam, rtol, checked, mesh, input_moments=input_moments,
        interference=interference,
    )  # fmt: skip
    return run.scores[0]


def task_energies(
    adapters: Sequence[Any], *, checked: bool = False, _fn: str = "nu.task_energies"
) -> jax.Array:
    """``||dW_i||_F^2`` summed over modules, per task, as ``(M,)``; from factor Grams.

    ``||s a b||_F^2 = s^2 sum((a^T a) * (b b^T))``: no dense update. Computed scale-safely (as
    :func:`score`); an energy beyond the compute dtype's range is an :class:`InputError`
    (:func:`heterogeneity` works with log-energies and stays defined).

    Args:
      adapters: sequence of M adapters, as in :func:`score`.
      checked: under a trace, report NaN/Inf inputs through :mod:`jax.experimental.checkify`
        (see :func:`score`).

    Raises:
      InputError: NaN/Inf in a factor or scale; an energy outside the compute dtype's range.
      InputTypeError: as :func:`score`.
    """
    checked = check_bool(_fn, "checked", checked)
    k, t, dtype = log_energies(adapters, _fn, checked)
    e = mul_pow2(t, k)
    if not isinstance(e, jax.core.Tracer):
        fi = np.finfo(np.dtype(dtype))
        e_np, t_np = np.asarray(e), np.asarray(t)
        out = np.flatnonzero((t_np > 0) & ~((e_np >= fi.tiny) & (e_np <= fi.max)))
        if out.size:
            i = int(out[0])
            l10 = (float(np.asarray(k)[i]) + float(np.log2(t_np[i]))) * np.log10(2.0)
            raise InputError(
                f"{_fn}: task {i}'s energy ||dW||_F^2 is about 1e{l10:+.0f}, outside "
                f"{range_text(dtype)}. Check its LoRA scales (lora_alpha / r), or {X64_HINT}; "
                "nu.heterogeneity works with log-energies and is defined."
            )
    return e


def heterogeneity(
    adapters: Sequence[Any],
    *,
    checked: bool = False,
    _fn: str = "nu.heterogeneity",
    _for_alpha: bool = False,
    _names: Sequence[str] | None = None,
) -> jax.Array:
    """Task heterogeneity ``h = Var_i[log ||dW_i||_F^2]`` (paper Eq. h; population variance).

    ``||dW_i||_F^2`` is task i's whole-adapter energy (all modules), from the factors. The paper
    finds h = 1.83 on its vision adapters (where it sets alpha = 0) and 0.63 on NLI (alpha = 1).
    The log-energies are computed from a mantissa and a power of two per task, so ``h`` is
    defined (and exact to rounding) for any finite scales, even where the energies themselves
    overflow.

    Args:
      adapters: sequence of M adapters, as in :func:`score`.
      checked: under a trace, report NaN/Inf inputs through :mod:`jax.experimental.checkify`
        (see :func:`score`).

    Returns:
      scalar ``h`` (0 for M = 1).

    Raises:
      InputError: a task's adapter is zero everywhere (its log-energy is undefined); NaN/Inf in a
        factor or scale. The error carries ``task_index`` (that task's position in
        ``adapters``) and ``argument`` (``"alpha"`` when :func:`score`'s ``alpha="auto"`` asked
        for ``h``, else None), for callers that name adapters and options their own way.
      InputTypeError: as :func:`score`.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> a, b = rng.normal(size=(16, 2)), rng.normal(size=(2, 8))
      >>> ads = [{"m": {"lora_a": a, "lora_b": b, "scale": c}} for c in (1.0, np.e)]
      >>> round(float(nu.heterogeneity(ads)), 4)  # log-energies differ by 2: variance 1
      1.0
      >>> ads = [{"m": {"lora_a": a, "lora_b": b, "scale": c}} for c in (1e30, np.e * 1e30)]
      >>> round(float(nu.heterogeneity(ads)), 4)  # energies ~1e60 overflow float32; h does not
      1.0
    """
    checked = check_bool(_fn, "checked", checked)
    k, t, _ = log_energies(adapters, _fn, checked)
    if not isinstance(t, jax.core.Tracer):
        zero = np.flatnonzero(np.asarray(t) <= 0)
        if zero.size:
            i = int(zero[0])
            who = f"task {i}" + (f" ({_names[i]!r})" if _names is not None else "")
            if _for_alpha:
                msg = (
                    f"{_fn}: alpha='auto' applies the heterogeneity rule, which needs every "
                    f"task's log-energy, but {who} (adapters[{i}]) has a zero update in every "
                    "module. Drop that adapter, or pass a number for alpha= (1.0 Gram geometry, "
                    "0.0 row space)."
                )
            else:
                msg = (
                    f"{_fn}: {who} has a zero update in every module; its log-energy is "
                    "undefined. Drop that adapter."
                )
            err = InputError(msg)
            err.task_index = i
            err.argument = "alpha" if _for_alpha else None
            raise err
    # log e_i = ln 2 (k_i + log2 t_i); the integer part is centred exactly before the float math
    return log_energy_variance(k, t)
