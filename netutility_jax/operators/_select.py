"""Selection kernels: exact top-k thresholds over float magnitudes, by their bit patterns.

TIES keeps each task's ``k`` largest-magnitude entries, exactly ``k`` of them (PEFT's count,
:func:`topk_count`, made on the host). The kernels here find the k-th largest magnitude without a
sort: non-negative floats order like their bit patterns, so a threshold is found bit by bit
(:func:`kth_largest_count`, two bits per pass over the data, inside one jitted call) or, when the
entries do not fit in memory at once (model-wide TIES), digit by digit from histograms that
stream (:func:`digit_histogram` per unit, :func:`radix_threshold` on the host), then applied with
ties broken in flat order (:func:`trim_at`, :func:`ties_apply`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "count_table_np",
    "digit_histogram",
    "kth_largest",
    "kth_largest_count",
    "radix_threshold",
    "topk_count",
    "trim_at",
    "trim_topk",
]

_BLOCK = 64  # entries per packed partial count in kth_largest_count


def uint_of(dtype):
    return {4: jnp.uint32, 8: jnp.uint64, 2: jnp.uint16}[jnp.dtype(dtype).itemsize]


def int_of(dtype):
    return {4: jnp.int32, 8: jnp.int64, 2: jnp.int16}[jnp.dtype(dtype).itemsize]


def kth_largest(x: jax.Array, k: jax.Array) -> jax.Array:
    """Exact k-th largest entry of the non-negative ``x (..., n)`` per leading index (``k >= 1``).

    Search over the bit patterns of the floats (monotone for non-negative values), two bits per
    pass over ``x``: ``O(n * bits / 2)`` with no sort and no ``top_k`` of size ``k``.
    """
    return kth_largest_count(x, k)[0]


def kth_largest_count(x: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`kth_largest` and how many entries are at least that large (``>= k``; ``== k`` when
    the entries at the threshold all fit in the top ``k``), at no extra pass over ``x``."""
    t, ge = _kth_pattern(jax.lax.bitcast_convert_type(x, int_of(x.dtype)), k)
    return jax.lax.bitcast_convert_type(t, x.dtype), ge


def _magnitude_pattern(x: jax.Array) -> jax.Array:
    """``|x|``'s bit patterns as signed integers (sign bit cleared): ordered like ``|x|``."""
    it = int_of(x.dtype)
    return jax.lax.bitcast_convert_type(x, it) & jnp.iinfo(it).max


def _kth_pattern(xi: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`kth_largest_count` on the non-negative bit patterns ``xi`` of non-negative floats."""
    # Non-negative floats have the sign bit clear, so their patterns compare the same as signed
    # integers and the sign bit needs no pass: 31 bits (63 in float64) are found two at a time,
    # each pass counting the entries at or above three candidates.
    it = xi.dtype
    bits = jnp.dtype(it).itemsize * 8 - 1
    n = xi.shape[-1]
    shape = xi.shape[:-1]
    # The three counts of a block of _BLOCK entries (each at most 64: 7 bits) are packed in one
    # float32 block sum (exact below 2**24): XLA:CPU streams the compare into a float sum, while
    # an integer sum of this length becomes a reduce-window over a materialised array, and three
    # separate sums read the data three times. Zero padding counts nothing (candidates are > 0).
    nb = -(-n // _BLOCK)
    xi = jnp.pad(xi, [(0, 0)] * (xi.ndim - 1) + [(0, nb * _BLOCK - n)])
    xi = xi.reshape(*xi.shape[:-1], nb, _BLOCK)
    k = jnp.asarray(k).astype(jnp.int32)

    def counts(cands):  # (..., 3) increasing candidates -> (..., 3) counts of xi >= each
        c = [cands[..., j, None, None] for j in range(3)]
        # xi's weight 1 + 128 [xi >= c1] + 16384 [xi >= c2] if xi >= c0, as one nested select
        w = jnp.where(xi >= c[2], 16513.0, jnp.where(xi >= c[1], 129.0, 1.0))
        packed = jnp.where(xi >= c[0], w, 0.0).astype(jnp.float32).sum(-1)
        p = packed.astype(jnp.int32)
        parts = [p & 127, (p >> 7) & 127, p >> 14]
        return jnp.stack([q.sum(-1, dtype=jnp.int32) for q in parts], -1)

    big = jnp.iinfo(it).max  # a candidate no entry reaches (patterns of finite floats are less)

    def body(i, carry):
        t, ge = carry
        # pass i decides bits hi = bits - 1 - 2 i and hi - 1 (only bit 0 on an odd last pass)
        low = jnp.maximum(bits - 2 - 2 * i, 0).astype(it)
        mult = jnp.arange(1, 4, dtype=it)
        valid = (i < bits // 2) | (mult == 1)  # bits is odd: the last pass has one candidate
        cands = jnp.where(valid, t[..., None] | (mult << low), big)
        cnt = counts(cands)
        j = (cnt >= k[..., None]).sum(-1)  # the counts decrease: the candidates kept are a prefix
        at = jnp.maximum(j - 1, 0)[..., None]
        take = j > 0
        t = jnp.where(take, jnp.take_along_axis(cands, at, -1)[..., 0], t)
        ge = jnp.where(take, jnp.take_along_axis(cnt, at, -1)[..., 0], ge)
        return t, ge

    init = (jnp.zeros(shape, it), jnp.full(shape, n, jnp.int32))
    return jax.lax.fori_loop(0, -(-bits // 2), body, init)


def topk_count(density, n):
    """TIES's kept-entry count for ``n`` entries: ``int(float(density) * n)``, PEFT's rule, exactly.

    The rule (PEFT's ``magnitude_based_pruning``: ``k = int(density * tensor.numel())`` with a
    Python float ``density``): the density as a binary64 number (a float32 or any other real is
    converted to it first, exactly where it can be), the integer ``n`` converted to binary64, one
    correctly rounded binary64 product, then truncated. ``n`` is an exact integer computed first
    (never a product of floats): ``0.3`` of ``96 x 25`` entries is ``int(0.3 * 2400) = 720``,
    while the left-to-right ``0.3 * 96 * 25`` gives 719. Computed on the host (Python or numpy
    binary64 arithmetic, identical by IEEE 754), never in a traced dtype: a float32 density or
    product would give other counts. Traced code receives counts made here (see
    :func:`nu.merge`).

    Args:
      density: a real number in ``[0, 1]``.
      n: a non-negative integer, or an integer array (one count per entry).

    Returns:
      ``k`` as a Python int, or an int64 numpy array of ``n``'s shape.
    """
    d = float(density)
    if isinstance(n, (int, np.integer)):
        return int(d * int(n))
    n = np.asarray(n)
    if not np.issubdtype(n.dtype, np.integer):
        raise TypeError(f"topk_count: n has dtype {n.dtype}; expected integers.")
    return np.floor(np.float64(d) * n.astype(np.int64).astype(np.float64)).astype(np.int64)


def trim_topk(x: jax.Array, k: jax.Array | int) -> jax.Array:
    """Keep exactly ``k`` largest-magnitude entries of each task ``x (..., M, p, q)``.

    ``k`` is a scalar or ``(...)`` (one count per leading index, shared by the M tasks); TIES uses
    ``k = int(density * n)`` over the ``n`` real entries (:func:`topk_count`). ``k = 0`` keeps
    nothing.

    Selection rule (deterministic, the same in every dtype and batch layout): entries are ranked by
    ``|x|`` as computed (bit patterns of the magnitudes, so ``-0.0 == 0.0``), and entries of equal
    magnitude by their flat row-major index over ``(p, q)``, lower first; the first ``k`` are kept.
    So exactly ``k`` entries are kept, as PEFT's ``magnitude`` prune does (``torch.topk``, whose
    order among equal values is unspecified). The rule is exact on the numbers it is given: two
    entries whose magnitudes differ by less than the rounding error of the computation that
    produced them (e.g. float32 KnOTS coordinates against float64 ones) may still be ordered
    differently in two precisions.
    """
    shape = x.shape
    flat = x.reshape(*shape[:-2], -1)
    n = flat.shape[-1]
    k = jnp.minimum(jnp.asarray(k, jnp.int32), n)[..., None, None]  # (..., 1, 1) over tasks, n
    mag = _magnitude_pattern(flat)  # one materialised array for the count passes and the trim
    t, ge = _kth_pattern(mag, jnp.maximum(k[..., 0], 1))
    t, ge = t[..., None], ge[..., None]
    # usually every entry at the threshold fits (continuous data: just the k-th one, so exactly k
    # are >= t), or the threshold is 0 (keeping zeros changes nothing); the running count that
    # breaks ties in flat order is only computed otherwise (outside vmap, the cond skips it)
    fits = jnp.all((ge <= k) | (t == 0))

    def by_flat_order(mag):
        above = mag > t
        at = mag == t
        room = k - above.sum(-1, keepdims=True, dtype=jnp.int32)
        return above | (at & (jnp.cumsum(at, -1, dtype=jnp.int32) <= room))

    keep = jax.lax.cond(fits, lambda mag: mag >= t, by_flat_order, mag)
    keep = keep & (k > 0)
    return jnp.where(keep, flat, 0).reshape(shape)


def digit_histogram(x: jax.Array, hi: jax.Array, *, shift: int, width: int) -> jax.Array:
    """One radix-select pass: per task, counts of ``|x|``'s bit digit among entries matching ``hi``.

    ``x (..., M, p, q)``; the magnitudes' bit patterns (monotone for non-negative floats) are split
    into a known prefix (the bits of ``hi (M,)`` above ``shift + width``) and the digit
    ``bits[shift : shift + width]``. Returns ``(M, 2**width)`` int32 counts of each digit over
    the entries whose prefix equals the task's ``hi``.
    """
    ut = uint_of(x.dtype)
    nbits = jnp.dtype(ut).itemsize * 8
    m = x.shape[-3]
    bits = jnp.moveaxis(jax.lax.bitcast_convert_type(jnp.abs(x), ut), -3, 0).reshape(m, -1)
    top = shift + width
    if top >= nbits:
        match = jnp.ones(bits.shape, bool)
    else:
        match = (bits >> jnp.asarray(top, ut)) == (hi.astype(ut)[:, None] >> jnp.asarray(top, ut))
    digit = ((bits >> jnp.asarray(shift, ut)) & jnp.asarray(2**width - 1, ut)).astype(jnp.int32)
    # one flat count over (task, digit) bins, unmatched entries in a spare last bin (XLA:CPU
    # scatters a 1-D bincount faster than a 2-D indexed add)
    idx = jnp.where(match, digit + (jnp.arange(m, dtype=jnp.int32) << width)[:, None], m << width)
    return jnp.bincount(idx.reshape(-1), length=(m << width) + 1)[:-1].reshape(m, 2**width)


def trim_at(x: jax.Array, t: jax.Array, room: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keep entries with ``|x| > t`` plus the first ``room`` entries with ``|x| == t``, per task.

    ``x (..., M, p, q)``; ``t (M,)`` thresholds as bit patterns of ``x``'s unsigned type;
    ``room (M,)`` int32. Ties are taken in flat order over the leading axes, then ``p``, ``q``.
    Returns ``(trimmed x, ties taken (M,))``.
    """
    ut = uint_of(x.dtype)
    m = x.shape[-3]
    xt = jnp.moveaxis(x, -3, 0)
    bits = jax.lax.bitcast_convert_type(jnp.abs(xt), ut).reshape(m, -1)
    tt = t.astype(ut)[:, None]
    at = bits == tt
    n_at = at.sum(-1, dtype=jnp.int32)
    # the running count that breaks ties in flat order (a slow scan on CPU) only where the ties
    # here do not all fit: in one unit of a model-wide TIES at most
    take = jax.lax.cond(
        jnp.all(n_at <= room),
        lambda at: at,
        lambda at: at & (jnp.cumsum(at, -1, dtype=jnp.int32) <= room[:, None]),
        at,
    )
    keep = (bits > tt) | take
    out = jnp.where(keep.reshape(xt.shape), xt, 0)
    return jnp.moveaxis(out, 0, -3), jnp.minimum(n_at, room)


# --------------------------------------------------------------------------- host-side counts


@functools.lru_cache(maxsize=32)
def count_table_np(density: float, p: int, q: int, has_left: bool) -> np.ndarray:
    """TIES's kept count for every ``n`` that ``(p, q)`` coordinates (:class:`spaces.Coords`)
    can have, made on the host by :func:`topk_count` (PEFT's rule, exact): ``table[rows, cols] =
    int(density * rows * cols)`` over the live rows (``0..p``; one row, ``p``, without a ``left``
    basis) and columns (``0..q``), int32, cached per shape and density. The compiled merge takes
    it as data (``_stages.count_input``) and looks its counts up: no count is ever computed in a
    traced (float32) dtype, and a new density compiles nothing."""
    rows = np.arange(p + 1, dtype=np.int64) if has_left else np.array([p], np.int64)
    n = rows[:, None] * np.arange(q + 1, dtype=np.int64)[None, :]
    return topk_count(density, n).astype(np.int32)


# ------------------------------------------------------------- streamed radix selection (host)


@functools.partial(jax.jit, static_argnames=("shift", "width"))
def _digit_hist(x, hi, *, shift, width):
    return digit_histogram(x, hi, shift=shift, width=width)


def radix_threshold(
    units: Iterable[tuple[Callable[[], jax.Array], Any]], m_tasks: int, k: int, dtype
) -> tuple[np.ndarray, ...]:
    """Per task the bit pattern ``t`` of its k-th largest magnitude over all ``units``, how many
    ties at ``t`` to keep (so that exactly ``k`` entries are kept) and how many entries are at
    ``t``. ``units`` is a re-iterable of ``(produce, _)`` whose ``produce()`` gives dense tasks
    ``(u, M, p, q)``; each 16-bit pass streams them once, keeping only the counts. An object
    whose ``__iter__`` reads them afresh each time is iterated once per pass (a one-shot
    iterator is listed first). ``k`` may be a function, called after the first pass (when the
    units are counted as they are streamed)."""
    if iter(units) is units:
        units = list(units)
    ut = np.dtype(uint_of(dtype))
    nbits, width = ut.itemsize * 8, 16
    zero = np.zeros(m_tasks, np.int64)
    nothing = np.full(m_tasks, np.iinfo(ut).max, ut), zero, zero
    if not callable(k) and k <= 0:  # keep nothing: no magnitude exceeds the largest pattern
        return nothing
    hi = np.zeros(m_tasks, np.uint64)
    above = np.zeros(m_tasks, np.int64)
    at = np.zeros(m_tasks, np.int64)
    for shift in range(nbits - width, -1, -width):
        counts = np.zeros((m_tasks, 2**width), np.int64)
        prefix = jnp.asarray(hi.astype(ut))
        for produce, _ in units:
            counts += np.asarray(_digit_hist(produce(), prefix, shift=shift, width=width))
        if callable(k):
            k = k()
            if k <= 0:
                return nothing
        for i in range(m_tasks):
            c = counts[i, ::-1]
            j = int(np.searchsorted(above[i] + np.cumsum(c), k))
            above[i] += int(c[:j].sum())
            at[i] = c[j]
            hi[i] |= np.uint64(2**width - 1 - j) << np.uint64(shift)
    return hi.astype(ut), k - above, at
