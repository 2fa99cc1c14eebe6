"""The float32 reference kernels, which the fused ones (Triton on a GPU, numba on the CPU) are tested against."""

from __future__ import annotations

from moerun.layers.attention import attend, norm_rope_store
from moerun.layers.norm import add_rms_norm, rms_norm
from moerun.layers.ops import Kernels

TORCH_KERNELS = Kernels(rms_norm, add_rms_norm, norm_rope_store, attend, None, {}, lambda linears: None)
