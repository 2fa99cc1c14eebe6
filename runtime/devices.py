"""Which device runs each block: the devices a model is loaded on, and how its blocks are split over them.

A model runs on one device or on several in a row (pipeline order, one token batch at a time): each block lives
wholly on one device (its weights, KV cache, RoPE table, router, expert slots), blocks form contiguous runs per
device, and the hidden state moves to the next device at a run boundary (models/base.py, Transformer.forward). The
token embedding sits with the first block, the final norm and output head with the last.

The split comes from the expert cache's placement when there is one (cache/placement.py: by each budget's share of
the slots), else from the blocks' bytes in the file: each device gets about an equal share of all weight bytes,
the embedding counted on the first device and the output head on the last
(llama.cpp's default layer split does the same by layer counts, weighted by free memory).

Several devices of type "cpu" are stand-ins for GPUs: the layout, the per-device step and the cache's per-device
state all run on a machine without a GPU, which is how the tests check them.

Letters: L blocks, N devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moeprep.gguf.roles import parse_tensor_name

DeviceSpec = str | torch.device | Sequence[str | torch.device]


@dataclass(frozen=True)
class DeviceMap:
    """devices [N] (CPU stand-ins may repeat "cpu") and, for each of the L blocks, the index of its device."""

    devices: tuple[torch.device, ...]
    block: tuple[int, ...]

    def device_of(self, layer: int) -> torch.device:
        return self.devices[self.block[layer]]

    @property
    def first(self) -> torch.device:
        """Where the embedding and the tokens go."""
        return self.devices[self.block[0]] if self.block else self.devices[0]

    @property
    def last(self) -> torch.device:
        """Where the final norm, the output head and the logits are."""
        return self.devices[self.block[-1]] if self.block else self.devices[0]

    def runs(self) -> list[tuple[torch.device, slice]]:
        """Consecutive blocks on one device: [(device, slice of blocks)], in order."""
        runs, start = [], 0
        for i in range(1, len(self.block) + 1):
            if i == len(self.block) or self.block[i] != self.block[start]:
                runs.append((self.devices[self.block[start]], slice(start, i)))
                start = i
        return runs

    @property
    def spans_devices(self) -> bool:
        """Does a step move between distinct devices (CPU stand-ins do not)?"""
        return len({self.devices[i] for i in self.block}) > 1


def resolve_devices(device: DeviceSpec, n: int | None = None, every_gpu: bool = False) -> list[torch.device]:
    """The devices to load on, each with its index ("cuda" -> cuda:0).

    device: "cpu", "cuda", "cuda:1", a comma-separated list ("cuda:0,cuda:1") or a list of devices. With `n` (one
    expert-cache budget per device) a single device stands for n of them: "cuda" the first n GPUs, "cuda:k" n GPUs
    from k, "cpu" n CPU stand-ins; a list must name n devices. Without `n`, `every_gpu` makes a bare "cuda" every
    visible GPU (the expert cache using all free VRAM). MoeprepError for anything that cannot run."""
    specs = (
        [s.strip() for s in device.split(",")]
        if isinstance(device, str)
        else [device]
        if isinstance(device, torch.device)
        else list(device)
    )
    try:
        devices = [torch.device(s) for s in specs]
    except (RuntimeError, TypeError) as e:
        raise MoeprepError(f"--device {device}: not a device; use cpu, cuda, cuda:N or a comma-separated list") from e
    if not devices:
        raise MoeprepError("--device: no device given; use cpu, cuda, cuda:N or a comma-separated list")
    if len({d.type for d in devices}) > 1:
        raise MoeprepError(f"--device {','.join(map(str, devices))}: mixes device types; list devices of one type")
    kind = devices[0].type
    if kind not in ("cpu", "cuda"):
        raise MoeprepError(f"--device {devices[0]}: moerun runs on cpu or cuda")
    if n is None and every_gpu and devices == [torch.device("cuda")] and torch.cuda.is_available():
        n = torch.cuda.device_count()
    if n is not None and len(devices) == 1 and n > 1:
        first = devices[0].index or 0
        devices = [torch.device(kind, first + i) if kind == "cuda" else devices[0] for i in range(n)]
    elif n is not None and len(devices) != n:
        raise MoeprepError(
            f"--vram-budget lists {n} budgets for the {len(devices)} devices "
            f"{','.join(map(str, devices))}; give one budget per device"
        )
    if kind == "cpu":
        return [torch.device("cpu")] * len(devices)
    if not torch.cuda.is_available():
        raise MoeprepError("--device cuda: no CUDA device is available; use --device cpu")
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", d.index or 0) for d in devices]
    if n is not None and n > count:
        raise MoeprepError(
            f"--vram-budget lists {n} budgets (one per GPU) but {count} GPU(s) are visible; give at "
            f"most {count} budgets or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    beyond = [str(d) for d in devices if d.index >= count]
    if beyond:
        raise MoeprepError(f"--device {','.join(beyond)}: {count} GPU(s) are visible (cuda:0 to cuda:{count - 1})")
    if len(set(devices)) < len(devices):
        raise MoeprepError(f"--device {','.join(map(str, devices))}: a GPU is listed twice; list each GPU once")
    return devices


def split_blocks(block_bytes: Sequence[int], n: int, first: int = 0, last: int = 0) -> list[int]:
    """[L] device index of each block: contiguous runs, each device about an equal share of all bytes. `first` and
    `last` are bytes that sit on the first and the last device (embedding, output head). Each block goes to the
    device whose share holds the block's middle byte."""
    sizes = np.array([first, *block_bytes, last], np.float64)
    total = sizes.sum()
    if total == 0 or n == 1:
        return [0] * len(block_bytes)
    middle = (np.cumsum(sizes) - sizes / 2)[1:-1]  # [L]
    return [int(d) for d in np.minimum(np.floor(middle / total * n), n - 1)]


def split_by_bytes(g: GGUFModel, devices: list[torch.device], n_layer: int) -> DeviceMap:
    """Blocks over `devices` by their bytes in the file (no expert cache: experts go with their block)."""
    per_block = np.zeros(n_layer, np.int64)
    first = last = 0
    tied_head = not any(t.name == "output.weight" for t in g.tensors)  # the output head is token_embd's copy
    for t in g.tensors:
        block = parse_tensor_name(t.name).block
        if block is not None and block < n_layer:
            per_block[block] += t.n_bytes
        elif t.name.startswith("token_embd."):
            first += t.n_bytes  # the embedding's rows, kept as they are (layers.Embedding)
            last += t.n_bytes if tied_head else 0
        elif block is None:
            last += t.n_bytes  # output head and final norm
    return DeviceMap(tuple(devices), tuple(split_blocks(per_block.tolist(), len(devices), first, last)))


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device (kernels, streams and events a block uses follow it); no-op on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
