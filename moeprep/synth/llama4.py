"""Llama 4 (`llama4`) as a synthetic architecture: dense and MoE layers interleaved, RoPE-less layers between RoPE
ones, a top-1 sigmoid router whose weight scales the expert's input, a shared expert beside the routed one.

Every `interleave_moe_layer_step`-th layer (here 2: layers 1, 3, ...) is MoE (ffn_gate_inp, *_exps, and a shared
expert *_shexp as wide as a routed one); the others have a dense FFN of feed_forward_length. Attention is plain GQA;
llama.cpp decides the rest from the layer index (every 4th layer without RoPE and with full attention, the others
RoPE'd with chunked attention and Q/K RMS-normalised), which the file does not describe: writing no
attention.sliding_window key selects that layout. Shapes and keys follow the llama.cpp vendored by
llama-cpp-python 0.3.36 (src/models/llama4.cpp). Letters as in parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import EXPERT_FF, GQA, ArchSpec, Moe, SharedExpert, T, TensorSpec, ffn, norm

MOE_STEP = 2  # Llama 4 Maverick interleaves every other layer; Scout (step 1) is all MoE


def is_moe(il: int) -> bool:
    return (il + 1) % MOE_STEP == 0


@dataclass(frozen=True)
class InterleavedArchSpec(ArchSpec):
    """An ArchSpec whose MoE layers are every MOE_STEP-th, the others dense (instead of leading dense layers)."""

    def layer_tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        ffn_part = self.moe.tensors(c, il) if is_moe(il) else ffn(c, il, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, c.n_ff)
        return [
            norm(T.ATTN_NORM, il, c.n_embd),
            *self.attention.tensors(c, il),
            norm(self.ffn_norm, il, c.n_embd),
            *ffn_part,
        ]


LLAMA4 = InterleavedArchSpec(
    MODEL_ARCH.LLAMA4,
    GQA(),
    Moe(shared=SharedExpert(lambda c: c.n_ff_exp)),
    derived={"n_layer": lambda g: max(g["n_layer"], 4), "n_expert_used": lambda g: 1},
    metadata=EXPERT_FF | {Keys.LLM.INTERLEAVE_MOE_LAYER_STEP: lambda c: MOE_STEP},
    checks=(
        (lambda c: c.n_expert_used == 1, "llama4 routes each token to one expert (n_expert_used 1)"),
        (lambda c: c.rope_dim == c.head_dim, "llama4 rotates whole heads (rope_dim == head_dim)"),
    ),
)
