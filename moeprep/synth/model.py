"""Write a synthetic MoE model: config -> tensor list -> bytes, streamed one tensor at a time, atomically.

The output depends only on the arguments: every tensor draws from its own generator seeded by (seed, name), and
gguf-py's writer adds no timestamps, so equal arguments give equal bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys, LlamaFileType

from moeprep.atomic import atomic_outputs
from moeprep.errors import MoeprepError
from moeprep.gguf.roles import TensorRole, parse_tensor_name, role_table, tensor_role
from moeprep.gguf.writer import KVValue
from moeprep.quant import registry
from moeprep.synth.archs import ARCHS
from moeprep.synth.chat import chat_metadata
from moeprep.synth.config import SynthConfig, resolve_config
from moeprep.synth.parts import ArchSpec, TensorSpec, model_metadata, model_tensors
from moeprep.synth.routing import shape_routing
from moeprep.synth.tokenizer import load_vocab, padded_vocab, sentencepiece_style, vocab_metadata
from moeprep.synth.weights import BIAS_CHANNEL, RANDOM_BLOCKS, byte_shape, quantize, random_blocks, tensor_rng

Q = GGMLQuantizationType
R = TensorRole
SYNTH_ARCHS: tuple[str, ...] = tuple(ARCHS)

# Storage type by tensor role. Router, norms and biases stay F32 and embeddings F16, as converters write them.
ROLE_TYPES: dict[TensorRole, Callable[[SynthConfig], GGMLQuantizationType]] = {
    R.EXPERT: lambda c: c.expert_type,
    R.ATTENTION: lambda c: c.attn_type,
    R.SHARED_EXPERT: lambda c: c.attn_type,
    R.DENSE_FFN: lambda c: c.attn_type,
    R.EMBEDDING: lambda c: Q.F16,
    R.OUTPUT: lambda c: Q.F16,
    R.ROUTER: lambda c: Q.F32,
    R.NORM: lambda c: Q.F32,
    R.OTHER: lambda c: Q.F32,
}
# Tensors whose type is fixed whatever attn_type says. attn_k_b: on CPUs with AMX, llama.cpp (0c1e570) puts an F16
# or quantized attn_k_b in its AMX buffer, whose matmul then refuses absorbed MLA's permuted activations and the
# graph fails to schedule (GGML_ASSERT(*cur_backend_id != -1)); F32 weights never go there.
# ffn_gate_tid2eid: DeepSeek-V4's token -> experts table, integers llama.cpp reads as I32.
PINNED_TYPES: dict[str, GGMLQuantizationType] = {"attn_k_b": Q.F32, "ffn_gate_tid2eid": Q.I32}
# general.file_type names the bulk of the bytes: the experts' type.
FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    Q.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}
QUANT_VERSION = 2  # general.quantization_version of current ggml block layouts
SYNTH_KEY_PREFIX = "moeprep.synth."


def synth_config(
    arch: str = "qwen3moe",
    *,
    preset: str = "tiny",
    seed: int = 0,
    expert_type: str | GGMLQuantizationType | None = None,
    attn_type: str | GGMLQuantizationType | None = None,
    skew: float = 0.0,
    fast_random_blocks: bool = False,
    **overrides,
) -> SynthConfig:
    """The resolved configuration write_synth_model would use (same arguments); None means the preset's value."""
    spec = ARCHS.get(arch)
    if spec is None:
        raise MoeprepError(f"unknown synthetic architecture {arch!r}; choose one of {', '.join(SYNTH_ARCHS)}")
    given = {"expert_type": expert_type, "attn_type": attn_type, **overrides}
    explicit = {k: v for k, v in given.items() if v is not None}
    explicit |= {"seed": seed, "skew": float(skew), "fast_random_blocks": fast_random_blocks}
    return resolve_config(arch, preset, spec.derived, explicit, spec.checks)


def storage_type(t: TensorSpec, c: SynthConfig, roles: dict[str, TensorRole]) -> GGMLQuantizationType:
    """Vectors and biases are F32; a matrix takes its pinned type, else its role's type, demoted as llama-quantize
    does when its rows do not fit that type's blocks (Q4_K rows of 64 values in the tiny preset become Q5_0);
    MXFP4, which the registry does not cover, falls back to F16."""
    name = parse_tensor_name(t.name)
    if len(t.shape) == 1 or name.suffix == "bias":
        return Q.F32
    if name.base in PINNED_TYPES:
        return PINNED_TYPES[name.base]
    qtype = dict(c.tensor_types).get(name.base) or ROLE_TYPES[tensor_role(t.name, roles)](c)
    if qtype in registry.QUANTIZERS:
        return registry.choose_type(qtype, t.shape[-1])[0]
    return qtype if t.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def planned_tensors(c: SynthConfig) -> tuple[list[TensorSpec], list[GGMLQuantizationType]]:
    """Every tensor of the model in file order, with its storage type."""
    spec = ARCHS[c.arch]
    tensors = shape_routing(c, model_tensors(spec, c, c.n_vocab))
    roles, _ = role_table(spec.name)
    return tensors, [storage_type(t, c, roles) for t in tensors]


def tensor_data_size(c: SynthConfig) -> int:
    """Bytes of tensor data the model will have (the file adds metadata and alignment padding)."""
    tensors, types = planned_tensors(c)
    return sum(int(np.prod(byte_shape(t.shape, q))) for t, q in zip(tensors, types))


def tensor_bytes(t: TensorSpec, qtype: GGMLQuantizationType, c: SynthConfig) -> np.ndarray:
    """uint8 [..., row_bytes]: random blocks straight away in fast mode, otherwise float draws then quantized."""
    rng = tensor_rng(c.seed, t.draw)
    # a constructed tensor (regime routing's context layer) is quantized from its values even in fast mode
    if c.fast_random_blocks and qtype in RANDOM_BLOCKS and not getattr(t.init, "exact", False):
        assert t.residual_axis in (None, -2), t.name  # residual biases are F32, never random blocks
        data = random_blocks(rng, t.shape, qtype, t.init.std)
        if t.residual_axis is not None:
            data[..., BIAS_CHANNEL, :] = 0
        return data
    values = t.init.sample(rng, t.shape)
    if t.residual_axis is not None:
        np.moveaxis(values, t.residual_axis, 0)[BIAS_CHANNEL] = 0
    return quantize(values, qtype)


def general_metadata(c: SynthConfig, types: list[GGMLQuantizationType]) -> dict[str, KVValue]:
    S, U32, F32, B = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
    keys = {
        Keys.General.NAME: KVValue(c.model_name, S),
        Keys.General.FILE_TYPE: KVValue(int(FILE_TYPES[c.expert_type]), U32),
    }
    if any(GGML_QUANT_SIZES[t][0] > 1 for t in types):
        keys[Keys.General.QUANTIZATION_VERSION] = KVValue(QUANT_VERSION, U32)
    return keys | {
        SYNTH_KEY_PREFIX + "preset": KVValue(c.preset, S),
        SYNTH_KEY_PREFIX + "seed": KVValue(c.seed, U32),
        SYNTH_KEY_PREFIX + "skew": KVValue(c.skew, F32),
        SYNTH_KEY_PREFIX + "fast_random_blocks": KVValue(c.fast_random_blocks, B),
    }


def tokenizer_metadata(spec: ArchSpec, c: SynthConfig) -> dict[str, KVValue]:
    """The tokenizer.ggml.* keys of the arch's tokenizer model, its vocabulary padded to n_vocab tokens: the shipped
    byte-level BPE ("gpt2"), or the same recast as SentencePiece-style pieces ("gemma4", which llama.cpp splits its
    own way and always starts with BOS: no pre-tokenizer name is written, as Gemma 4's converter writes none)."""
    if spec.tokenizer == "gemma4":
        return vocab_metadata(padded_vocab(sentencepiece_style(load_vocab()), c.n_vocab), model="gemma4", pre=None)
    return vocab_metadata(padded_vocab(load_vocab(), c.n_vocab))


def write_synth_model(
    path: str | Path,
    arch: str = "qwen3moe",
    *,
    preset: str = "tiny",
    seed: int = 0,
    expert_type: str | GGMLQuantizationType | None = None,
    attn_type: str | GGMLQuantizationType | None = None,
    skew: float = 0.0,
    n_layer: int | None = None,
    n_expert: int | None = None,
    n_expert_used: int | None = None,
    n_embd: int | None = None,
    n_ff_exp: int | None = None,
    fast_random_blocks: bool = False,
    chat_template: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
    **overrides,
) -> Path:
    """Write a synthetic `arch` model of `preset`'s shape to `path` (atomically); returns the path.

    expert_type / attn_type: F32 F16 BF16 Q8_0 Q4_0 Q4_K Q6_K MXFP4 (None: the preset's). attn_type covers every
    always-resident matrix: attention, shared experts, dense FFN layers. skew 0..1: uneven expert popularity.
    fast_random_blocks: quantized tensors as valid random blocks (no float weights; minutes for 17 GB).
    chat_template: write a ChatML template with tool calls (moeprep/synth/chat.py), for serving the model.
    overrides: any SynthConfig field (head_dim, n_head_kv, mla_split, yarn, rope_scaling, sliding_window, ...).
    on_tensor(name, n_bytes) is called after each tensor is written (progress bars)."""
    sizes = {
        "n_layer": n_layer,
        "n_expert": n_expert,
        "n_expert_used": n_expert_used,
        "n_embd": n_embd,
        "n_ff_exp": n_ff_exp,
    }
    c = synth_config(
        arch,
        preset=preset,
        seed=seed,
        expert_type=expert_type,
        attn_type=attn_type,
        skew=skew,
        fast_random_blocks=fast_random_blocks,
        **sizes,
        **overrides,
    )
    path = Path(path)
    if not path.parent.is_dir():
        raise MoeprepError(f"{path.parent}: output folder does not exist")
    spec: ArchSpec = ARCHS[arch]
    if chat_template and spec.tokenizer != "gpt2":
        raise MoeprepError(f"--chat-template needs the byte-level BPE vocabulary; {arch} writes {spec.tokenizer}'s")
    tensors, types = planned_tensors(c)

    writer = GGUFWriter(path=None, arch=spec.name)
    metadata = general_metadata(c, types) | model_metadata(spec, c) | tokenizer_metadata(spec, c)
    if chat_template:
        metadata |= chat_metadata()
    for key, kv in metadata.items():
        writer.add_key_value(key, kv.value, kv.vtype, kv.sub_type)
    for t, qtype in zip(tensors, types):
        shape = byte_shape(t.shape, qtype)
        writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=qtype)
    with atomic_outputs([path]) as (tmp,):
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t, qtype in zip(tensors, types):
                data = tensor_bytes(t, qtype, c)
                writer.write_tensor_data(data)
                if on_tensor is not None:
                    on_tensor(t.name, data.nbytes)
        finally:
            writer.close()
    return path
