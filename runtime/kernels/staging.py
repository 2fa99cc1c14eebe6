"""The second bank of an expert-cache bank: where the GPU reads it, and the copy of a step's missed experts from it.

A bank of the expert cache names a second bank (QWeight.second) whose matrix e the matrix-vector kernel runs for
slot -2 - e: the layer's experts in page-locked host memory, read over the bus at the address the CUDA driver maps
them to (cuMemHostGetDevicePointer, through libcuda), or a staging bank on the device that `stage_second` copied the
step's missed experts into.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from moerun.kernels import tuning
from moerun.kernels.qweight import QWeight


@triton.jit
def _stage_kernel(slot_ptr, dst_ptr, src_delta, words, src_words, BLOCK: tl.constexpr):
    """Program (p, c): words c*BLOCK .. c*BLOCK+BLOCK-1 of the matrix that pair p names in the second bank (slot
    -2 - e; the bank at src_delta words from dst_ptr, its matrices src_words apart), copied to matrix p of the
    staging bank at dst_ptr. Pairs with other slots copy nothing."""
    p = tl.program_id(0)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    if slot < -1:
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < words
        src = dst_ptr + src_delta + (-2 - slot) * src_words + i
        tl.store(dst_ptr + p * words + i, tl.load(src, mask=ok), mask=ok)


def stage_second(
    slots: torch.Tensor,
    banks: tuple[QWeight, ...],
    stages: tuple[torch.Tensor, ...],
) -> tuple[tuple[QWeight, ...], torch.Tensor]:
    """Copy the second-bank matrices that `slots` (T, K) name (-2 - e) into the device staging banks `stages`
    ((>= T*K, N, row_bytes) uint8 each, one per bank), in wide coalesced loads: from page-locked host memory such a
    copy reads 44-50 GB/s on the H200 machine, where the matrix-vector kernel's own loads over the bus reach 24
    (docs/history/benchmarks-log.md). Matrix p = t*K + k of a stage holds pair p's expert; in a batch of several tokens, an
    expert streamed for several pairs is copied once, into its first pair's matrix, which the others read too.
    -> the banks with the staging banks as their second, and the slots of the streamed pairs pointing there (-2 - p)."""
    n_pairs = slots.numel()
    if slots.shape[0] > 1:  # one token's K experts differ: only a batch repeats one
        copies, owner = _first_pairs(slots, banks[0].second.shape[0])
    else:
        copies, owner = slots, torch.arange(n_pairs, device=slots.device).view(slots.shape)
    staged = []
    for w, stage in zip(banks, stages):
        matrix = w.data[0].numel()
        delta = _second_address(w) - stage.data_ptr()
        src_stride = w.second.stride(0)  # a matrix's bytes, or more where the second bank is a fused gate/up's half
        # the widest words that divide the matrix, its stride and both banks' addresses (a host copy may start 4
        # bytes past one)
        size = next(
            n
            for n in (8, 4, 1)
            if matrix % n == 0 and src_stride % n == 0 and delta % n == 0 and stage.data_ptr() % n == 0
        )
        assert stage.shape[0] >= n_pairs and stage.shape[1:] == w.data.shape[1:]
        words = stage.view(-1).view({8: torch.int64, 4: torch.int32, 1: torch.uint8}[size])
        _stage_kernel[(n_pairs, triton.cdiv(matrix // size, tuning.STAGE_WORDS))](
            copies,
            words,
            delta // size,
            matrix // size,
            src_stride // size,
            BLOCK=tuning.STAGE_WORDS,
            num_warps=tuning.STAGE_WARPS,
        )
        staged.append(dataclasses.replace(w, second=stage))
    return tuple(staged), torch.where(slots < -1, -2 - owner, slots).to(slots.dtype)


def _first_pairs(slots: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the streamed pairs of `slots` (T, K) (slot -2 - e), the first pair p0 = t*K + k that streams the same
    expert, on the device: (the slots the copy kernel takes: the pair's own where it is that first pair, else -1;
    p0 of every pair, itself where it streams nothing)."""
    flat = slots.reshape(-1).long()
    pairs = torch.arange(flat.numel(), device=slots.device)
    streamed = flat < -1
    expert = torch.where(streamed, -2 - flat, n_expert)  # the others share a spare bucket
    first = torch.full((n_expert + 1,), flat.numel(), dtype=torch.long, device=slots.device)
    first.scatter_reduce_(0, expert, pairs, reduce="amin")
    owner = torch.where(streamed, first[expert], pairs)
    copies = torch.where(streamed & (owner == pairs), flat, -1).to(slots.dtype)
    return copies.view(slots.shape), owner.view(slots.shape)


def second_delta(w: QWeight) -> int:
    """Where the bank's second bank lies for the matrix-vector kernel, as a byte offset from its bytes (0: it has
    none). The kernel finds its matrix e slot_bytes * e past its start, as in the bank itself: page-locked copies
    and staging banks are laid out so (a fused gate/up's halves are copied apart when pinned)."""
    if w.second is None:
        return 0
    assert w.second.stride(0) == w.slot_bytes, (w.second.stride(), w.slot_bytes)
    return _second_address(w) - w.data.data_ptr()


def _second_address(w: QWeight) -> int:
    """The address the bank's device reads its second bank at (host memory through the driver's mapping)."""
    assert w.second.shape[1:] == w.data.shape[1:] and w.second.data_ptr() % 4 == 0, (
        tuple(w.second.shape),
        tuple(w.data.shape),
    )
    return _bus_address(w.second.data_ptr(), w.data.is_cuda and not w.second.is_cuda)


@functools.cache
def _bus_address(address: int, on_host: bool) -> int:
    """The address a GPU reads page-locked host memory at (`on_host`: the driver's mapping; on x86-64 Linux the
    host's own address); memory on the kernel's own device is where it is."""
    if not on_host:
        return address
    mapped = ctypes.c_uint64()
    error = _libcuda().cuMemHostGetDevicePointer_v2(ctypes.byref(mapped), ctypes.c_void_p(address), 0)
    if error:
        raise RuntimeError(f"host memory at {address:#x} is not page-locked for CUDA (driver error {error})")
    return mapped.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")
