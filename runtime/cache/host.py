"""The expert cache's host side: where the routed experts' bytes live in RAM, and whether the GPU can take them all.

Uploads from the memory-mapped GGUF go through the driver's bounce buffer and the host waits for each; from
page-locked memory they run asynchronously at the bus's speed (55 GB/s against 7 measured on the H200 machine).
So on CUDA, when free RAM holds the experts, each layer's expert bytes are copied once into page-locked memory.
"""

from __future__ import annotations

import mmap
import warnings
import weakref

import numpy as np
import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE
from moeprep.gguf.reader import GGUFModel
from moeprep.units import format_size
from moerun.kernels.cpu.formats import ExpertBytes

PIN_SPARE = 8 << 30  # RAM left free after pinning the experts


def host_experts(g: GGUFModel, layer: int) -> tuple[ExpertBytes, ExpertBytes, ExpertBytes]:
    """A layer's gate, up and down expert tensors as host bytes (views of the memory map; a fused gate/up's halves
    strided row ranges of it) with their biases."""
    from moerun.weights import expert_bytes

    return expert_bytes(g, layer)


def page_locked(data: np.ndarray, readers: tuple[torch.device, ...]) -> np.ndarray:
    """A C-contiguous copy of `data` in page-locked memory registered with CUDA (torch's pinned allocator rounds sizes
    up to a power of two, which would nearly double a layer's experts), which the GPUs `readers` copy from. (`data`
    may be a fused gate/up's half, a strided view: its copy is contiguous, the layout the kernels' second bank has.)"""
    page = mmap.PAGESIZE
    raw = np.empty(data.nbytes + page, np.uint8)
    start = -raw.ctypes.data % page
    copy = raw[start : start + data.nbytes].reshape(data.shape)
    torch.from_numpy(copy).copy_(read_only_tensor(data))  # torch's copy is multi-threaded
    # flags 0 (cudaHostRegisterDefault): with unified addressing (every 64-bit process) the range is mapped and
    # portable, so every GPU's context reads it in place, at the host address (decode steps stream misses from it)
    error = torch.cuda.cudart().cudaHostRegister(copy.ctypes.data, copy.nbytes, 0)
    if int(error) != 0:
        raise MoeprepError(
            f"cannot page-lock {format_size(copy.nbytes)} of expert bytes (CUDA error {int(error)}); "
            "run without pinning (CacheConfig(pin=False)) or free RAM"
        )
    weakref.finalize(raw, _unregister, copy.ctypes.data, readers)
    return copy


def _unregister(address: int, readers: tuple[torch.device, ...]) -> None:
    """Unregister page-locked expert bytes once no GPU reads them any more: uploads run asynchronously on copy
    streams, so a model dropped while its last step's uploads are under way must not free their source first."""
    for device in readers:
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(address)


def read_only_tensor(data: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only array (the memory map) that is only ever read: without torch's warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data))


def should_pin(expert_bytes: int, device: torch.device) -> bool:
    """Pin on CUDA when the routed experts (`expert_bytes`, the anatomy's) fit the RAM that is free now, with
    PIN_SPARE to spare."""
    return device.type == "cuda" and expert_bytes + PIN_SPARE <= available_ram()


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return 0


def fits_device(g: GGUFModel, device: str) -> bool:
    """Do all of the model's weights fit the device's free memory, less the reserve for activations and KV?"""
    device_ = torch.device(device)
    if device_.type != "cuda" or not torch.cuda.is_available():
        return True
    free = torch.cuda.mem_get_info(device_)[0]
    return sum(t.n_bytes for t in g.tensors) + DEFAULT_RESERVE <= free
