"""vLLM's default EPLB policy (DeepSeek EPLB), in NumPy, vectorised across layers and batches.

Same placements as vLLM's ``DefaultEplbPolicy.rebalance_experts`` (``vllm/distributed/eplb/policy/
default.py``, the same file in 0.32 and 0.33), including its tie-breaking and its float32 view of the load, and
the same ``log2phy`` / ``logcnt`` as vLLM's ``compute_logical_maps``. vLLM loops over layers in
Python; here every step runs on all rows (layers x batch x nodes) at once, so a loop only goes over
the items of one pack or the replicas of one node.

Shapes (L layers, E logical experts, R physical slots = ``num_replicas``, P GPUs, S = R / P slots
per GPU, B batch):

- ``weight``: ``[L, E]`` load of each logical expert (tokens, any non-negative number)
- ``phy2log``: ``[L, R]`` int64, logical expert held by each physical slot; GPU-major, so slots
  ``g*S .. (g+1)*S-1`` are GPU g's
- ``log2phy``: ``[L, E, M]`` int64, the physical slots of each logical expert in increasing order,
  padded with -1; M = the largest replica count in the call
- ``logcnt``: ``[L, E]`` int64, replica count of each logical expert (>= 1, sums to R per layer)

The policy (hierarchical when ``num_groups % num_nodes == 0``, else global, i.e. the same with one
group and one node):

1. pack the E / G-expert groups onto the nodes, heaviest group first into the lightest node that
   still has room (every node gets G / N groups);
2. inside each node, add R/N - E/N replicas one at a time, each to the expert with the largest
   ``load / replica_count`` (first such expert on a tie);
3. pack the node's replicas (each carrying ``load / replica_count``) onto the node's GPUs the same
   way as in step 1 (every GPU gets S).

Ties in the heaviest-first order are broken by ``numpy.argsort`` (not a stable sort), exactly as in
vLLM, so on integer loads with equal values the placement depends on NumPy's sort on this CPU --
for vLLM as for this module; both agree on the same machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_eplb.eplb.replay import kernels

__all__ = [
    "PolicyError",
    "Layout",
    "check_layout",
    "rebalance",
    "rebalance_batch",
    "logical_to_physical",
]


_CHUNK_ROWS = 256  # layer rows per vectorised pass in rebalance_batch


class PolicyError(ValueError):
    """Arguments the policy cannot work with.

    ``param`` names the offending argument (``weight``, ``num_replicas``, ``num_groups``,
    ``num_nodes``, ``num_gpus`` or ``old_phy2log``) so callers such as the CLI can name their own
    flag for it.
    """

    def __init__(self, param: str, message: str, where: tuple[int, int] | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message
        self.where = where  # (matrix, layer) of the load at fault, when one is


@dataclass(frozen=True)
class Layout:
    """A checked placement problem: sizes plus which variant of the policy vLLM runs.

    ``groups`` and ``nodes`` are the values the policy really uses: the given ones when
    ``hierarchical``, else 1 and 1 (vLLM's global policy).
    """

    num_experts: int
    num_replicas: int
    groups: int
    nodes: int
    num_gpus: int
    hierarchical: bool

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def num_redundant(self) -> int:
        return self.num_replicas - self.num_experts


def _positive_int(param: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PolicyError(param, f"must be a whole number, got {value!r}")
    if value < 1:
        raise PolicyError(param, f"must be >= 1, got {value}")
    return int(value)


def check_layout(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Layout:
    """Check the sizes the way vLLM's policy asserts them, with an explanation instead.

    Raises:
        PolicyError: naming the argument and the fix.
    """
    num_experts = _positive_int("weight", num_experts)
    num_replicas = _positive_int("num_replicas", num_replicas)
    num_groups = _positive_int("num_groups", num_groups)
    num_nodes = _positive_int("num_nodes", num_nodes)
    num_gpus = _positive_int("num_gpus", num_gpus)
    if num_replicas % num_gpus:
        raise PolicyError(
            "num_replicas",
            f"{num_replicas} physical slots cannot be split evenly over {num_gpus} GPUs; "
            f"use a multiple of {num_gpus} (e.g. {num_replicas + (-num_replicas) % num_gpus})",
        )
    if num_replicas < num_experts:
        raise PolicyError(
            "num_replicas",
            f"{num_replicas} slots cannot hold {num_experts} logical experts; "
            f"need at least {num_experts} (logical + redundant experts)",
        )
    hierarchical = num_groups % num_nodes == 0
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    if hierarchical:
        if num_experts % groups:
            raise PolicyError(
                "num_groups",
                f"{num_experts} experts cannot be split into {groups} equal groups; "
                f"use a divisor of {num_experts}",
            )
        if num_gpus % nodes:
            raise PolicyError(
                "num_gpus",
                f"{num_gpus} GPUs cannot be split evenly over {nodes} nodes; use a multiple of "
                f"{nodes} (vLLM itself falls back to num_nodes=1 in that case)",
            )
    return Layout(num_experts, num_replicas, groups, nodes, num_gpus, hierarchical)


def _as_load(weight: object, ndim: int, what: str) -> np.ndarray:
    """The load as vLLM sees it: ``torch.Tensor.float()``, i.e. float32."""
    try:
        arr = np.asarray(weight)
    except (TypeError, ValueError) as exc:
        raise PolicyError("weight", f"not a numeric array ({exc})") from None
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
    ) or np.issubdtype(arr.dtype, np.complexfloating):
        raise PolicyError("weight", f"must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise PolicyError("weight", f"expected a {what} array, got shape {arr.shape}")
    if 0 in arr.shape:
        raise PolicyError("weight", f"shape {arr.shape} is empty; need at least one layer and expert")
    with np.errstate(over="ignore", invalid="ignore"):
        w32 = arr.astype(np.float32)
    bad = ~np.isfinite(w32) | (w32 < 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise PolicyError(
            "weight",
            f"weight{list(idx)} = {arr[idx].item()!r}; loads must be finite, >= 0 and fit in float32",
            (idx[0], idx[1]) if ndim == 3 else None,
        )
    return np.ascontiguousarray(w32)


def _gather(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Row-wise ``arr[x, idx[x, j]]`` for 2-D arrays (``np.take_along_axis``, without overhead)."""
    offsets = (np.arange(idx.shape[0]) * arr.shape[1])[:, None]
    return arr.reshape(-1)[idx + offsets]


def _heaviest_first(weight: np.ndarray) -> np.ndarray:
    """Row-wise item order, heaviest first; ties as NumPy's default (unstable) sort leaves them,
    which is what vLLM gets."""
    return np.argsort(-weight, axis=-1)


def _balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack the n items of each row into ``num_packs`` packs of n / num_packs items each.

    Items go heaviest first (``argsort(-weight)``, vLLM's order) into the lightest pack that is not
    full (lowest pack index on a tie). Pack loads accumulate in float64 in that order, as in vLLM.

    Args:
        weight: ``[X, n]`` item weights (float32 or float64, as vLLM passes them).
        num_packs: packs per row; divides n.

    Returns:
        ``[X, n]`` int64: the item at position ``pack * (n / num_packs) + rank_in_pack`` -- the
        inverse of vLLM's ``pack_index * per_pack + rank_in_pack``.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n, dtype=np.int64), (rows, n)).copy()

    order = _heaviest_first(weight)
    # Column k (made contiguous) = each row's k-th heaviest item.
    sorted_w = np.ascontiguousarray(_gather(weight, order).T)  # [n, X]
    pack_w = np.zeros((rows, num_packs), dtype=np.float64)
    pack_w_flat = pack_w.reshape(-1)
    pack_n = np.zeros(rows * num_packs, dtype=np.int64)
    position = np.empty((n, rows), dtype=np.int64)  # where the k-th heaviest item goes
    base = np.arange(rows) * num_packs
    for k in range(n):
        pack = pack_w.argmin(axis=1)
        slot = base + pack
        count = pack_n[slot]
        position[k] = pack * per_pack + count
        pack_w_flat[slot] += sorted_w[k]
        count += 1
        pack_n[slot] = count
        pack_w_flat[slot[count == per_pack]] = np.inf
    out = np.empty((rows, n), dtype=np.int64)
    out.reshape(-1)[position.T + (np.arange(rows) * n)[:, None]] = order
    return out


def _replicate(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """Give each row's n experts ``num_phy`` replicas, one extra at a time, to the expert with the
    largest ``weight / count`` (first on a tie), computed in float64 as vLLM does.

    Args:
        weight: ``[X, n]`` float32 load per expert.
        num_phy: replicas per row, >= n.

    Returns:
        phy2log ``[X, num_phy]`` (the first n slots are experts 0..n-1, then the extra replicas
        in the order they were added) and logcnt ``[X, n]``, int64.
    """
    rows, n = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    logcnt = np.ones((rows, n), dtype=np.int64)
    if num_phy == n:
        return phy2log, logcnt
    ratio = weight.astype(np.float64)  # == weight / 1 in vLLM's float64 promotion
    w_flat = weight.reshape(-1)
    cnt_flat = logcnt.reshape(-1)
    ratio_flat = ratio.reshape(-1)
    base = np.arange(rows) * n
    for i in range(n, num_phy):
        best = ratio.argmax(axis=1)
        phy2log[:, i] = best
        flat = base + best
        cnt = cnt_flat[flat] + 1
        cnt_flat[flat] = cnt
        ratio_flat[flat] = w_flat[flat] / cnt  # float32 / int64 -> float64, like vLLM
    return phy2log, logcnt


def _rebalance_rows_jit(w32: np.ndarray, layout: Layout) -> np.ndarray:
    """:func:`_rebalance_rows` with the loops compiled (:mod:`~moe_eplb.eplb.replay.kernels`); the sorts
    and the float32 group sums stay NumPy's, so ties and rounding are the same."""
    rows, num_experts = w32.shape
    groups, nodes = layout.groups, layout.nodes
    group_size = num_experts // groups
    if groups == 1:
        mlog2log = np.broadcast_to(np.arange(num_experts, dtype=np.int64), (rows, num_experts)).copy()
    else:
        tokens_per_group = w32.reshape(rows, groups, group_size).sum(axis=-1)
        mlog2log = kernels.group_packing(tokens_per_group, _heaviest_first(tokens_per_group), nodes, group_size)
    slots_per_node = layout.num_replicas // nodes
    phy2mlog, tokens_per_phy = kernels.replicate(w32, mlog2log, nodes, slots_per_node)
    gpus_per_node = layout.num_gpus // nodes
    order = phy2mlog if gpus_per_node == slots_per_node else _heaviest_first(tokens_per_phy)
    return kernels.gpu_packing(tokens_per_phy, order, gpus_per_node, phy2mlog, mlog2log, nodes)


def _rebalance_rows(w32: np.ndarray, layout: Layout) -> np.ndarray:
    """phy2log ``[X, R]`` for float32 load ``w32[X, E]`` (X = any number of independent rows)."""
    if kernels.enabled():
        return _rebalance_rows_jit(w32, layout)
    rows, num_experts = w32.shape
    groups, nodes = layout.groups, layout.nodes
    group_size = num_experts // groups
    experts_per_node = num_experts // nodes
    slots_per_node = layout.num_replicas // nodes

    # Step 1: groups -> nodes. mlog (node-major logical order) -> logical expert. With one node
    # but several groups vLLM still sorts the groups heaviest first, which reorders the experts.
    if groups == 1:
        mlog2log = np.broadcast_to(np.arange(num_experts, dtype=np.int64), (rows, num_experts))
        tokens_per_mlog = w32
    else:
        tokens_per_group = w32.reshape(rows, groups, group_size).sum(axis=-1)
        # node-major group position -> group; experts keep their order inside a group
        pos2group = _balanced_packing(tokens_per_group, nodes)
        mlog2log = (
            (pos2group * group_size)[..., None] + np.arange(group_size, dtype=np.int64)
        ).reshape(rows, num_experts)
        tokens_per_mlog = _gather(w32, mlog2log)
    tokens_per_mlog = tokens_per_mlog.reshape(rows * nodes, experts_per_node)

    # Step 2: replicas inside each node.
    phy2mlog, mlogcnt = _replicate(tokens_per_mlog, slots_per_node)

    # Step 3: each node's replicas -> its GPUs (float32 load / int64 count -> float64, as vLLM).
    tokens_per_phy = _gather(tokens_per_mlog / mlogcnt, phy2mlog)
    pphy2phy = _balanced_packing(tokens_per_phy, layout.num_gpus // nodes)
    pphy2mlog = _gather(phy2mlog, pphy2phy).reshape(rows, nodes, slots_per_node)
    pphy2mlog = pphy2mlog + (np.arange(nodes, dtype=np.int64) * experts_per_node)[None, :, None]
    return _gather(np.ascontiguousarray(mlog2log), pphy2mlog.reshape(rows, -1))


def _preserve_intragpu_slots(new: np.ndarray, old: np.ndarray, num_gpus: int) -> np.ndarray:
    """vLLM's ``preserve_intragpu_slots`` on rows ``[X, R]``: on each GPU, an expert that stays
    keeps its old slot (old slots scanned in order, each taking the first unused equal new slot);
    the other new experts fill the freed slots in order."""
    rows, num_slots = new.shape
    per_gpu = num_slots // num_gpus
    new_g = new.reshape(rows * num_gpus, per_gpu)
    old_g = old.reshape(rows * num_gpus, per_gpu)
    post = new_g.copy()
    used = np.zeros(new_g.shape, dtype=bool)
    kept = np.zeros(new_g.shape, dtype=bool)
    for s in range(per_gpu):
        matches = (new_g == old_g[:, s : s + 1]) & ~used
        first = matches.argmax(axis=1)
        hit = np.flatnonzero(matches[np.arange(len(first)), first])
        post[hit, s] = old_g[hit, s]
        used[hit, first[hit]] = True
        kept[hit, s] = True
    # Each row frees as many slots as it has leftover experts; pair them in order, row by row.
    post[~kept] = new_g[~used]
    return post.reshape(rows, num_slots)


def _check_old(old_phy2log: object, shape: tuple[int, ...], num_experts: int) -> np.ndarray:
    old = np.asarray(old_phy2log)
    if old.shape != shape:
        raise PolicyError(
            "old_phy2log",
            f"shape {old.shape} does not match the new placement {shape}; slots are only kept "
            "when the number of layers, slots and GPUs is unchanged",
        )
    if not np.issubdtype(old.dtype, np.integer):
        raise PolicyError("old_phy2log", f"must hold integer expert ids, got dtype {old.dtype}")
    if old.size and (old.min() < -1 or old.max() >= num_experts):
        raise PolicyError(
            "old_phy2log", f"expert ids must lie in -1..{num_experts - 1} (-1: empty slot)"
        )
    return old.astype(np.int64, copy=False)


def logical_to_physical(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``log2phy`` and ``logcnt`` from ``phy2log``, as vLLM's ``compute_logical_maps``.

    Args:
        phy2log: ``[..., R]`` int, logical expert of each slot (-1: empty slot, ignored).
        num_experts: E.

    Returns:
        log2phy ``[..., E, M]`` int64: each expert's slots in increasing order, padded with -1,
        M = max replica count over the whole input (at least 1); logcnt ``[..., E]`` int64.
    """
    p2l = np.asarray(phy2log, dtype=np.int64)
    lead, num_slots = p2l.shape[:-1], p2l.shape[-1]
    flat = p2l.reshape(-1, num_slots)
    rows = flat.shape[0]
    if kernels.enabled() and flat.size and int(flat.max()) < num_experts:  # compiled: no bounds checks
        log2phy, logcnt = kernels.logical_maps(np.ascontiguousarray(flat), num_experts)
        return log2phy.reshape(*lead, num_experts, log2phy.shape[-1]), logcnt.reshape(*lead, num_experts)
    # One key per slot: (row, expert), empty slots (-1) as expert E, a bin dropped at the end.
    # A single stable sort of all keys (radix for 16-bit keys) lists each row's experts in order,
    # each expert's slots in increasing order.
    bins = rows * (num_experts + 1)
    keys = np.where(flat >= 0, flat, num_experts) + (np.arange(rows) * (num_experts + 1))[:, None]
    keys = keys.reshape(-1)
    counts = np.bincount(keys, minlength=bins)
    logcnt = counts.reshape(rows, num_experts + 1)[:, :num_experts]
    max_rep = max(int(logcnt.max(initial=0)), 1)
    key_dtype = np.uint16 if bins <= 1 << 16 else np.int64
    order = np.argsort(keys.astype(key_dtype, copy=False), kind="stable")  # flat slot ids
    sorted_keys = keys[order]
    rank = np.arange(keys.size) - (np.cumsum(counts) - counts)[sorted_keys]  # replica number
    row, expert = np.divmod(sorted_keys, num_experts + 1)
    keep = expert < num_experts
    log2phy = np.full((rows, num_experts, max_rep), -1, dtype=np.int64)
    dest = (row * num_experts + expert) * max_rep + rank
    log2phy.reshape(-1)[dest[keep]] = (order % num_slots)[keep]
    return log2phy.reshape(*lead, num_experts, max_rep), logcnt.astype(np.int64).reshape(*lead, num_experts)


def _checked_inputs(weight: object, ndim: int, what: str, sizes: tuple[int, int, int, int],
                    old_phy2log: object) -> tuple[np.ndarray, Layout, np.ndarray | None]:
    """The load as float32 (``ndim`` dimensions, named ``what``), the layout of ``sizes`` (replicas,
    groups, nodes, GPUs) and the current placement if given, each checked."""
    w32 = _as_load(weight, ndim, what)
    num_experts = w32.shape[-1]
    layout = check_layout(num_experts, *sizes)
    if old_phy2log is None:
        return w32, layout, None
    return w32, layout, _check_old(old_phy2log, (*w32.shape[:-1], layout.num_replicas), num_experts)


def rebalance_batch(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                    old_phy2log: np.ndarray | None = None,
                    with_logcnt: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Run the policy on B independent load matrices at once (for simulators and tuners).

    Each ``weight[b]`` gets exactly what ``rebalance(weight[b], ...)`` would give; one call on B
    matrices costs about as much as a few single calls, so batch every rearrangement you can.

    Args:
        weight: ``[B, L, E]`` load (tokens) per logical expert, finite and >= 0.
        num_replicas, num_groups, num_nodes, num_gpus: as in :func:`rebalance`.
        old_phy2log: optional ``[B, L, R]`` current placement; experts that stay on a GPU keep
            their slot (vLLM passes its current map, so this is what a running server does).
        with_logcnt: False skips counting the replicas (logcnt is then None).

    Returns:
        phy2log ``[B, L, R]`` and logcnt ``[B, L, E]``, int64. Use :func:`logical_to_physical`
        for log2phy.

    Raises:
        PolicyError: bad sizes or load, naming the argument.
    """
    w32, layout, old = _checked_inputs(weight, 3, "B x L x E", (num_replicas, num_groups, num_nodes, num_gpus),
                                       old_phy2log)
    return _rebalance_checked(w32, layout, old, with_logcnt)


_F32_MAX = float(np.finfo(np.float32).max)
_SCALE_FIX = ("scale every load down by the same factor (e.g. divide by 1e6): only the ratios "
              "between loads matter to the placement")


def _where(row: int, layers: int, batched: bool) -> str:
    batch, layer = divmod(row, layers)
    return f"matrix {batch}, layer {layer}" if batched else f"layer {layer}"


def _refuse_first(bad: np.ndarray, layers: int, batched: bool, problem: Callable[[int, int], str]) -> None:
    """Raise for the first ``(row, index)`` of ``bad`` (``np.argwhere``'s answer), if any: where it is,
    ``problem(row, index)``, and the fix."""
    if bad.size:
        row, index = (int(i) for i in bad[0])
        raise PolicyError("weight", f"{_where(row, layers, batched)}: {problem(row, index)}; {_SCALE_FIX}",
                          divmod(row, layers))


def _check_group_sums(rows: np.ndarray, layout: Layout, layers: int, batched: bool) -> None:
    """Refuse loads whose per-group sum is not finite in float32, the precision vLLM sums the
    groups in (step 1); an infinite group load breaks the packing (a full node looks free)."""
    if layout.groups == 1:
        return
    size = rows.shape[1] // layout.groups
    with np.errstate(over="ignore"):
        sums = rows.reshape(rows.shape[0], layout.groups, size).sum(axis=-1)  # as _rebalance_rows
    _refuse_first(np.argwhere(~np.isfinite(sums)), layers, batched, lambda row, group: (
        f"expert group {group} (experts {group * size}..{(group + 1) * size - 1}) sums to more than float32 "
        f"holds ({_F32_MAX:.3g})"))


def _check_gpu_sums(rows: np.ndarray, phy2log: np.ndarray, layout: Layout, layers: int,
                    batched: bool) -> None:
    """Refuse loads that put more than float32 holds on one GPU (the sum of its slots' shares,
    load / replica count): per-GPU loads (balancedness, the simulator) would be infinite."""
    n = rows.shape[0]
    offsets = np.arange(n)[:, None] * rows.shape[1]
    cnt = np.bincount((phy2log + offsets).reshape(-1), minlength=rows.size).reshape(rows.shape)
    share = (rows.astype(np.float64) / cnt)[np.arange(n)[:, None], phy2log]  # [n, R]
    per_gpu = share.reshape(n, layout.num_gpus, layout.slots_per_gpu).sum(axis=-1)
    _refuse_first(np.argwhere(per_gpu > _F32_MAX), layers, batched, lambda row, gpu: (
        f"GPU {gpu} would carry {per_gpu[row, gpu]:.3g} tokens, more than float32 holds ({_F32_MAX:.3g})"))


def _rebalance_checked(
    w32: np.ndarray, layout: Layout, old: np.ndarray | None, with_logcnt: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`rebalance_batch` on validated input: float32 ``[B, L, E]``, int64 ``[B, L, R]``."""
    batch, layers, num_experts = w32.shape
    rows = w32.reshape(batch * layers, num_experts)
    old_rows = None if old is None else old.reshape(batch * layers, layout.num_replicas)
    # One max decides for almost every input that no per-group / per-GPU sum can overflow.
    near_limit = float(rows.max()) * max(num_experts // layout.groups, layout.slots_per_gpu) > _F32_MAX / 2
    if near_limit:
        _check_group_sums(rows, layout, layers, batch > 1)
    phy2log = np.empty((batch * layers, layout.num_replicas), dtype=np.int64)
    # Rows are independent; chunks keep the working set in cache (several times faster on big
    # batches than one pass over all rows).
    for start in range(0, batch * layers, _CHUNK_ROWS):
        stop = start + _CHUNK_ROWS
        chunk = _rebalance_rows(rows[start:stop], layout)
        if old_rows is not None:
            chunk = _preserve_intragpu_slots(chunk, old_rows[start:stop], layout.num_gpus)
        phy2log[start:stop] = chunk
    if near_limit:
        _check_gpu_sums(rows, phy2log, layout, layers, batch > 1)
    phy2log = phy2log.reshape(batch, layers, layout.num_replicas)
    if not with_logcnt:
        return phy2log, None
    offsets = np.arange(batch * layers)[:, None] * num_experts
    logcnt = np.bincount((offsets + phy2log.reshape(batch * layers, -1)).reshape(-1),
                         minlength=batch * layers * num_experts)
    return phy2log, logcnt.reshape(batch, layers, num_experts).astype(np.int64)


def rebalance(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
              old_phy2log: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place ``num_replicas`` physical experts on ``num_gpus`` GPUs, as vLLM 0.32 does.

    Same result as ``DefaultEplbPolicy.rebalance_experts(torch.tensor(weight), num_replicas,
    num_groups, num_nodes, num_gpus, old_phy2log)`` followed by ``compute_logical_maps``.

    Args:
        weight: ``[L, E]`` load (tokens) per logical expert, finite and >= 0; read as float32,
            as vLLM does.
        num_replicas: physical slots R (logical + redundant experts), a multiple of num_gpus.
        num_groups: expert groups G (DeepSeek-V3: 8); E must be a multiple when the policy is
            hierarchical.
        num_nodes: nodes N. Hierarchical when G % N == 0 (then num_gpus must be a multiple of N),
            else global.
        num_gpus: GPUs (EP ranks) P.
        old_phy2log: optional ``[L, R]`` current placement whose kept experts stay in their slot.

    Returns:
        ``(phy2log [L, R], log2phy [L, E, M], logcnt [L, E])``, int64 (see the module docstring).

    Raises:
        PolicyError (a ValueError): bad sizes or load, naming the argument and the fix.
    """
    w32, layout, old = _checked_inputs(weight, 2, "L x E", (num_replicas, num_groups, num_nodes, num_gpus), old_phy2log)
    phy2log, _ = _rebalance_checked(w32[None], layout, None if old is None else old[None], with_logcnt=False)
    log2phy, logcnt = logical_to_physical(phy2log[0], w32.shape[1])
    return phy2log[0], log2phy, logcnt
