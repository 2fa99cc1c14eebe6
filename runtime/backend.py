"""Every implementation choice of the runtime, made once per device at build time: which `Kernels` the layers run
(fused Triton on a GPU, numba on the CPU, or the torch reference), which Linear a GGUF tensor becomes (its blocks on
the GPU, its bytes on the CPU, or a dense copy) and which ExpertCompute a layer's routed experts get. Layers never
choose (layers/); BuildContext (models/base.py) asks the backend of the device it builds on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

import torch

from moerun.hooks import Hooks
from moerun.kernels.cpu import fused as cpu_fused
from moerun.kernels.ggml_cpu import GgmlCPU
from moerun.kernels.tuning import INT8_ON, Int8Routes
from moerun.layers.attention import attend, norm_rope_store, qk_norms_per_head
from moerun.layers.ffn import Activation
from moerun.layers.gguf_cpu import CPUExperts, CPUQuantLinear
from moerun.layers.linear import Linear
from moerun.layers.moe import ExpertCompute, GGUFExperts
from moerun.layers.norm import add_rms_norm, rms_norm
from moerun.layers.ops import Kernels
from moerun.layers.reference import TORCH_KERNELS
from moerun.options import RuntimeOptions
from moerun.weights import Weights


@dataclass(frozen=True)
class Backend:
    """The implementations for one device under one set of options."""

    device: torch.device
    options: RuntimeOptions
    kernels: Kernels
    ggml: GgmlCPU | None  # the ggml library whose row dots the CPU layers run (None: moerun's numba kernels)

    @property
    def routes(self) -> Int8Routes:
        """The 8-bit routes the GPU products take (MOERUN_GEMV_INT8, MOERUN_GEMM_INT8)."""
        return self.options.int8_routes()

    def linear(
        self,
        w: Weights,
        prefix: str,
        hooks: Hooks,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> Linear:
        """GGUF tensor `prefix`.weight (and `prefix`.bias if the file has it) as a Linear: on a GPU multiplying its
        blocks where the kernels decode its type; on the CPU its bytes where a row kernel reads them (products of a
        few tokens); else a dense copy in the weights' compute dtype (or `dtype`, reshaped to `shape`)."""
        if dtype is None and shape is None:
            name = f"{prefix}.weight"
            blocks = w.blocks(name)
            if blocks is not None:
                from moerun.layers.gguf_gpu import QuantLinear  # Triton: only CUDA builds of torch bring it

                return QuantLinear(blocks, w.optional(f"{prefix}.bias", torch.float32), name, hooks, self.routes)
            info = w.info(name)
            if self.device.type == "cpu" and len(info.shape) == 2:
                if CPUQuantLinear.can_run(info.ggml_type, self.ggml):
                    return CPUQuantLinear.load(w, prefix, hooks, w.optional(f"{prefix}.bias", torch.float32), self.ggml)
        return Linear.load(w, prefix, hooks, dtype, shape)

    def experts(self, w: Weights, hooks: Hooks, layer: int, activation: Activation) -> ExpertCompute:
        """The routed experts of `layer`: on a GPU DeviceExperts where the kernels decode the experts' types, on the
        CPU CPUExperts where its kernels do, otherwise the reference GGUFExperts."""
        if self.device.type == "cpu" and CPUExperts.can_run(w, layer):
            return CPUExperts.load(w, hooks, layer, activation, self.kernels, self.ggml)
        if self.device.type == "cuda":
            from moerun.layers.gguf_gpu import DeviceExperts  # Triton: only CUDA builds of torch bring it

            if DeviceExperts.can_run(w, layer):
                return DeviceExperts.load(w, hooks, layer, activation, self.kernels, self.routes)
        return GGUFExperts.load(w, hooks, layer, activation, self.kernels)


@functools.cache
def backend_for(device: torch.device, options: RuntimeOptions) -> Backend:
    """The backend of `device`: fused kernels on a GPU (Triton) and on the CPU (numba, where they beat torch's),
    the torch reference with options.fused off and on other devices; on the CPU, ggml's row dots where the library
    is there and options.ggml_cpu is on."""
    cpu = (lambda: fused_kernels(options.int8_routes())) if options.triton_on_cpu else cpu_kernels
    builders = {"cuda": lambda: fused_kernels(options.int8_routes()), "cpu": cpu} if options.fused else {}
    return Backend(
        device,
        options,
        builders.get(device.type, lambda: TORCH_KERNELS)(),
        options.ggml_library() if device.type == "cpu" else None,
    )


def cpu_kernels() -> Kernels:
    """numba's Q/K norm + RoPE and expert choice; torch's norms and attention, which were as fast or faster."""

    def cpu_norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache):
        """norm_rope_store with the Q/K norms per head (or absent) and RoPE in numba, k and v then stored by
        KVCache.update; olmoe's whole-projection norms take the torch reference."""
        per_head = qk_norms_per_head(q, q_norm, k_norm)
        if per_head is None:
            return norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        neox = rope.style == "neox"
        q, k = (
            cpu_fused.norm_rope_rows(
                x,
                norm.weight if per_head else None,
                norm.eps if per_head else 0.0,
                rope.cos,
                rope.sin,
                step.positions,
                neox,
            )
            for x, norm in ((q, q_norm), (k, k_norm))
        )
        return q, *cache.update(step, k, v)

    return Kernels(rms_norm, add_rms_norm, cpu_norm_rope_store, attend, cpu_fused.route, {}, lambda linears: None)


def fused_kernels(routes: Int8Routes = INT8_ON) -> Kernels:
    """Triton's fused norms, Q/K norm + RoPE + KV store, decode attention, routing and SwiGLU; QuantLinear stacks
    the rows of q, k and v into one product."""
    from moerun.kernels import fused  # Triton: present where CUDA is
    from moerun.layers.gguf_gpu import QuantLinear

    def fused_norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache):
        """One launch where the Q/K norms are per head (or absent), else the torch reference. k and v go straight
        into the cache rows (slot = position, kv_cache.py) of the step's one sequence, or of each token's in a step
        across sequences; a captured prompt step (its sequences per block of tokens) hands them to KVCache.update."""
        per_head = qk_norms_per_head(q, q_norm, k_norm)
        if per_head is None:
            return norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        n = step.n_slots
        if step.in_place:
            slots = (cache.k[step.seq], cache.v[step.seq], None)
        elif step.seqs is not None:  # a token each: every sequence's rows, written at (seqs[t], positions[t])
            slots = (cache.k, cache.v, step.seqs)
        else:
            slots = (None, None, None)
        q, k, v = fused.qkv_rope(
            q,
            k,
            v,
            q_norm.weight if per_head else None,
            k_norm.weight if per_head else None,
            q_norm.eps if per_head else 0.0,
            rope.cos,
            rope.sin,
            step.positions,
            rope.style == "neox",
            cache.k.dtype,
            *slots,
        )
        if step.in_place:
            return q, k[:n], v[:n]
        if step.seqs is not None:
            return q, k[:, :n], v[:, :n]
        return q, *cache.update(step, k, v)

    def fused_attend(q, k, v, allowed, scale, sinks=None, seqs=None):
        """Decode-sized steps (of one sequence, or one token of each of several) in the split kernel; prefill and
        prompts mixed with decode tokens in torch."""
        if fused.attend_supports(q, k, v, seqs):
            return fused.attend_decode(q, k, v, allowed, scale, sinks, seqs)
        return attend(q, k, v, allowed, scale, sinks, seqs)

    def fused_attend_i8(q, k, v, allowed, scale, sinks=None, seqs=None):
        """fused_attend, and its output's rounding for the output projection where the split kernel makes it."""
        if fused.attend_supports(q, k, v, seqs):
            return fused.attend_decode_i8(q, k, v, allowed, scale, sinks, seqs, routes)
        return attend(q, k, v, allowed, scale, sinks, seqs), None

    return Kernels(
        fused.rms_norm,
        fused.add_rms_norm,
        fused_norm_rope_store,
        fused_attend,
        fused.route,
        {"swiglu": fused.swiglu},
        QuantLinear.stack_rows,
        partial(fused.add_rms_norm_i8, routes=routes),
        fused_attend_i8,
    )
