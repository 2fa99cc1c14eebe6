"""Where the expert cache's slots go: how many per MoE layer, and which GPU runs each layer. Pure arithmetic.

Each GPU's budget (its VRAM, or `--vram-budget`) first pays for its share of the non-expert weights and a reserve
for activations and KV growth, as moeprep.gguf.anatomy.plan_vram counts it; what is left holds expert slots.

Slots follow measured need. With a profile's usage counts, slot k of layer l is worth the share of l's selections
its k-th hottest expert takes (what a cache of that size hits, statically), and slots go greedily to the best worth
per byte: a layer whose routing is spread wider needs more slots for the same hit rate and gets them. Without a
profile every layer gets an equal share (round robin). Every MoE layer gets at least one slot.

Layers go to GPUs as contiguous blocks, each GPU's block holding about its budget's share of the slots' bytes.
Blocks, not interleaved layers: a token's hidden state crosses GPUs once per block boundary instead of at every
layer, and within a step the layers run one after another whichever GPU holds them, so interleaving would buy no
parallelism. Balancing the blocks by budget uses every GPU's memory (no slots pile up on GPU 0), and gives each GPU
the share of the expert work its slots attract; the CPU computes each layer's misses while its GPU runs the hits.
The split is then fixed, and each GPU's slots are re-allotted within its own budget, so no GPU goes over.

Letters: L blocks, M MoE layers, E experts per layer, G GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE, Anatomy, plan_vram
from moeprep.units import format_size, parse_size


@dataclass(frozen=True)
class Placement:
    device: tuple[int, ...]  # [L] GPU of each decoder block (dense blocks sit with their neighbours; no NextN)
    slots: tuple[int, ...]  # [L] expert slots of each decoder block, 0 for a dense block
    budgets: tuple[int, ...]  # [G] bytes each GPU may use
    used: tuple[int, ...]  # [G] bytes planned on each GPU: reserve + non-expert share + slots
    cache_bytes: tuple[int, ...]  # [G] of which expert slots
    n_expert: int
    moe_layers: tuple[int, ...]
    pinned: tuple[int, ...] = ()  # blocks whose slots hold every expert, never evicted (cache/plan.py)

    @property
    def share(self) -> float:
        """Share of all routed experts the slots hold."""
        return sum(self.slots) / (len(self.moe_layers) * self.n_expert)

    def describe(self) -> str:
        """What moerun prints at start: slots per layer, GPU blocks, bytes per GPU, the share cached."""
        lines = [
            f"expert cache: {sum(self.slots)} slots = {self.share:.1%} of {len(self.moe_layers)} x "
            f"{self.n_expert} experts"
        ]
        for g, (budget, used, cache) in enumerate(zip(self.budgets, self.used, self.cache_bytes)):
            blocks = [b for b in self.moe_layers if self.device[b] == g]
            span = f"blocks {blocks[0]}-{blocks[-1]}" if blocks else "no MoE blocks"
            lines.append(
                f"  gpu {g}: {span}, {format_size(cache)} of slots, {format_size(used)} of "
                f"{format_size(budget)} planned; slots per layer " + " ".join(str(self.slots[b]) for b in blocks)
            )
        if self.pinned:
            lines.append(f"  pinned whole (every expert, never evicted): blocks {', '.join(map(str, self.pinned))}")
        return "\n".join(lines)


def parse_budgets(text: str) -> list[int]:
    """'24G,24G' -> bytes per GPU."""
    return [parse_size(part) for part in text.split(",")]


def slot_room(anatomy: Anatomy, budgets: list[int], reserve: int = DEFAULT_RESERVE) -> int:
    """Bytes all GPUs have for expert slots after the non-expert weights and the reserve (0 for a dense model)."""
    plan = plan_vram(anatomy, budgets, reserve)
    return 0 if plan is None else sum(g.free for g in plan.gpus)


def place(
    anatomy: Anatomy,
    budgets: list[int],
    reserve: int = DEFAULT_RESERVE,
    usage: np.ndarray | None = None,
    pinned: tuple[int, ...] = (),
) -> Placement:
    """Slots per MoE layer and a GPU per block. usage: [M, E] or [L, E] (dense rows zero) selection counts from a
    profile, or None for equal shares. pinned: MoE blocks whose slots hold every expert (the others share what is
    left). MoeprepError when the budgets cannot hold one slot per layer."""
    geo = anatomy.geometry
    plan = plan_vram(anatomy, budgets, reserve)
    if plan is None:
        raise MoeprepError(f"{anatomy.name}: a dense model has no routed experts to cache")
    layers = list(geo.moe_layers)
    expert_bytes = np.array([geo.expert_bytes[b] for b in layers], np.int64)  # [M]
    usage = usage_rows(usage, geo.n_layer, layers, geo.n_expert, len(geo.nextn_layers))
    worth = _slot_worth(usage, len(layers), geo.n_expert)  # [M, E]
    free = np.array([g.free for g in plan.gpus], np.int64)  # [G]
    floor = np.where(np.isin(layers, pinned), geo.n_expert, 1)  # [M] slots a layer gets before any other
    if free.sum() < expert_bytes.sum():
        raise MoeprepError(
            f"VRAM budget {', '.join(format_size(b) for b in budgets)}: after the non-expert weights "
            f"and a {format_size(reserve)} reserve per GPU, {format_size(int(free.sum()))} is left, "
            f"less than one expert slot in each of {len(layers)} MoE layers "
            f"({format_size(int(expert_bytes.sum()))}); give a larger --vram-budget"
        )
    if free.sum() < (floor * expert_bytes).sum():
        raise MoeprepError(
            f"VRAM budget {', '.join(format_size(b) for b in budgets)}: no room to pin "
            f"{len(pinned)} whole layers and keep a slot in every other"
        )
    demand = _allot(worth, expert_bytes, int(free.sum()), floor)
    gpu_of = _split(demand * expert_bytes, free)  # [M]
    slots = np.zeros(len(layers), np.int64)
    for g in range(len(free)):
        mine = np.flatnonzero(gpu_of == g)
        if not len(mine):
            continue
        if free[g] < (floor[mine] * expert_bytes[mine]).sum():
            raise MoeprepError(
                f"gpu {g}: {format_size(int(free[g]))} left after its share of the non-expert "
                f"weights and the reserve cannot hold one slot in each of its {len(mine)} MoE "
                f"layers; give it a larger --vram-budget or use fewer GPUs"
            )
        slots[mine] = _allot(worth[mine], expert_bytes[mine], int(free[g]), floor[mine])
    n_blocks = geo.n_layer - len(geo.nextn_layers)  # the decoder's blocks: NextN blocks are not run
    device = _block_devices(n_blocks, layers, gpu_of)
    per_block = np.zeros(n_blocks, np.int64)
    per_block[layers] = slots
    cache = np.bincount(gpu_of, weights=slots * expert_bytes, minlength=len(free)).astype(np.int64)
    used = [int(c) + g.non_expert + g.reserve for c, g in zip(cache, plan.gpus)]
    return Placement(
        device=tuple(device),
        slots=tuple(int(s) for s in per_block),
        budgets=tuple(budgets),
        used=tuple(used),
        cache_bytes=tuple(int(c) for c in cache),
        n_expert=geo.n_expert,
        moe_layers=tuple(layers),
        pinned=tuple(sorted(pinned)),
    )


def usage_rows(
    usage: np.ndarray | None, n_layer: int, layers: list[int], n_expert: int, n_nextn: int = 0
) -> np.ndarray | None:
    if usage is None:
        return None
    usage = np.asarray(usage)
    rows = usage.shape[0] if usage.ndim == 2 else -1
    # one row per MoE layer, or per block (the decoder's blocks: the trailing NextN blocks may be left out)
    if usage.ndim != 2 or usage.shape[1] != n_expert or rows not in (len(layers), n_layer, n_layer - n_nextn):
        raise MoeprepError(
            f"expert usage of shape {usage.shape} does not fit this model ({len(layers)} MoE of "
            f"{n_layer} layers, {n_expert} experts); use a profile made for this model"
        )
    return usage if rows == len(layers) else usage[layers]


def _slot_worth(usage: np.ndarray | None, n_moe: int, n_expert: int) -> np.ndarray:
    """[M, E] worth of each layer's k-th slot: the share of its selections the k-th hottest expert takes (flat
    1/E for a layer without counts, or without a profile)."""
    if usage is None:
        return np.full((n_moe, n_expert), 1.0 / n_expert)
    total = usage.sum(axis=1, keepdims=True)
    shares = np.where(total > 0, usage / np.maximum(total, 1), 1.0 / n_expert)
    return -np.sort(-shares, axis=1)


def _allot(worth: np.ndarray, expert_bytes: np.ndarray, budget: int, floor: np.ndarray | None = None) -> np.ndarray:
    """[M] slots: `floor` per layer (one where None), then greedily the slot of best worth per byte that still fits (ties: fewer slots
    first, then the lower layer, so equal worth goes round robin)."""
    n_m, n_e = worth.shape
    slots = np.ones(n_m, np.int64) if floor is None else np.asarray(floor, np.int64).copy()
    left = budget - int((slots * expert_bytes).sum())
    assert left >= 0
    k, m = np.meshgrid(np.arange(1, n_e), np.arange(n_m))  # slot k (0-based) of layer m, k >= 1
    per_byte = worth[:, 1:] / expert_bytes[:, None]
    order = np.lexsort((m.ravel(), k.ravel(), -per_byte.ravel()))
    for i in order:
        layer = m.flat[i]
        if slots[layer] == k.flat[i] and expert_bytes[layer] <= left:  # a layer's slots are taken in order
            slots[layer] += 1
            left -= int(expert_bytes[layer])
    return slots


def _split(demand: np.ndarray, free: np.ndarray) -> np.ndarray:
    """[M] GPU of each MoE layer: contiguous blocks, the boundaries where the cumulative demand crosses each GPU's
    cumulative share of the free bytes."""
    ends = np.cumsum(free) / free.sum() * demand.sum()  # [G]
    middle = np.cumsum(demand) - demand / 2  # each layer counted where its bytes are centred
    return np.minimum(np.searchsorted(ends, middle, side="right"), len(free) - 1)


def _block_devices(n_layer: int, layers: list[int], gpu_of: np.ndarray) -> list[int]:
    """A GPU per block: MoE blocks as split, a dense block with the next MoE block (trailing ones with the last)."""
    nearest = np.minimum(np.searchsorted(layers, np.arange(n_layer)), len(layers) - 1)
    return [int(g) for g in gpu_of[nearest]]
