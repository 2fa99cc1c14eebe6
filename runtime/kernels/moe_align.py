"""The (token, expert) pairs of a prompt step grouped by bank slot, for the grouped GEMM's programs.

Nothing here synchronises with the host: the grouping runs on the device into buffers of a size known from the
shapes alone, so that a prompt step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_pairs", "n_slots", "n_blocks"])
def _group_kernel(
    slots_ptr,
    ids_ptr,
    block_slot_ptr,
    n_pairs,
    n_slots,
    n_blocks,
    BM: tl.constexpr,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
):
    """Program s writes slot s's run of group_by_slot's ids and block_slot; the last program also the spare blocks.

    Every program counts the pairs of every slot (BINS >= n_slots + 1 bins; the pairs the GEMM does not run, slot -1
    and a second bank's -2 - e, count in bin n_slots), so that it knows where its run starts without waiting for the
    others: after the runs of the slots before it, each padded to a multiple of BM."""
    s = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    counts = tl.zeros((BINS,), tl.int32)
    for c in range(0, n_pairs, CHUNK):
        key = tl.load(slots_ptr + c + lane, mask=c + lane < n_pairs, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((key >= 0) & (key < n_slots), key, n_slots), BINS)
    padded = tl.where(bins < n_slots, (counts + BM - 1) // BM * BM, 0)
    first = tl.sum(tl.where(bins < s, padded, 0))  # where slot s's run starts in ids
    mine = tl.sum(tl.where(bins == s, counts, 0))
    run = tl.sum(tl.where(bins == s, padded, 0))
    at = first
    for c in range(0, n_pairs, CHUNK):  # slot s's pair ids in their order
        key = tl.load(slots_ptr + c + lane, mask=c + lane < n_pairs, other=-1).to(tl.int32)
        hit = (key == s).to(tl.int32)
        tl.store(ids_ptr + at + tl.cumsum(hit, 0) - 1, c + lane, mask=hit != 0)
        at += tl.sum(hit)
    pad = tl.arange(0, BM)
    tl.store(ids_ptr + first + mine + pad, -1, mask=pad < run - mine)
    for j in range(0, run, BM):
        tl.store(block_slot_ptr + (first + j) // BM, s)
    if s == n_slots - 1:  # the spare blocks past the last run
        used = tl.sum(padded)
        for c in range(used, n_blocks * BM, CHUNK):
            tl.store(ids_ptr + c + lane, -1, mask=c + lane < n_blocks * BM)
        for c in range(used // BM, n_blocks, CHUNK):
            tl.store(block_slot_ptr + c + lane, -1, mask=c + lane < n_blocks)


def group_by_slot(slots: torch.Tensor, n_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots (T, K) -> (ids, block_slot): the (t, k) pair ids t*K + k grouped by slot (in pair order within a slot),
    each slot's run padded with -1 to a multiple of block_m, and the slot of every block of block_m ids (-1 for the
    spare blocks at the end). Pairs of slot -1 (and of a second bank, -2 - e) are left out.

    Sizes depend only on T*K, n_slots and block_m (at most one partly filled block per slot present), so nothing
    waits for the device. One launch (_group_kernel): the torch sort, counts, cumsum and searchsorted it replaced
    were ~20 kernels, 88-93 us a prompt layer on the H200 (docs/history/benchmarks-log.md).
    """
    pairs = slots.reshape(-1)
    n_pairs = pairs.numel()
    n_blocks = triton.cdiv(n_pairs, block_m) + min(n_slots, n_pairs)
    ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=slots.device)
    block_slot = torch.empty(n_blocks, dtype=torch.int32, device=slots.device)
    # one chunk size for any number of pairs: a step of another size compiles nothing
    _group_kernel[(n_slots,)](
        pairs,
        ids,
        block_slot,
        n_pairs,
        n_slots,
        n_blocks,
        BM=block_m,
        CHUNK=1024,
        BINS=triton.next_power_of_2(n_slots + 1),
    )
    return ids, block_slot
