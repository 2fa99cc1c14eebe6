"""Export trained weights (train.py's shards) to the bench GGUFs: an F16 master, then the quantized variant.

    python -m bench.train_moe.export --weights RUN_FOLDER --tokenizer work/tokenizer.json --out bench/models

Tensor names, order and shapes and the qwen3moe metadata keys come from the synthetic-model generator
(moeprep.synth.parts.model_tensors / model_metadata with the bench sizes), the tokenizer keys from
moeprep.synth.tokenizer.vocab_metadata, so the bench model and the synthetic ones are laid out identically.

  bench-qwen3moe-f16.gguf     matrices F16, router and norms F32 (as llama.cpp's converter writes them)
  bench-qwen3moe-q4k.gguf     token_embd Q6_K (it is the tied output: llama-quantize's Q4_K_M rule for output),
                              attention Q8_0, experts Q4_K (ffn_down rows are 128 long: Q5_0, llama-quantize's
                              fallback), router and norms F32; written by moeprep's writer from the F16 master
The Q4_K-attention variant is `moeprep quantize bench-qwen3moe-q4k.gguf OUT --attn Q4_K` (docs/train-moe.md).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys, LlamaFileType

from bench.train_moe.model import ModelArgs
from bench.train_moe.train import load_shards
from moeprep.atomic import atomic_outputs
from moeprep.gguf.reader import GGUFModel, TensorInfo, open_gguf
from moeprep.gguf.roles import TensorRole, role_table, tensor_role
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, write_gguf
from moeprep.quant.registry import choose_type, quantize_rows
from moeprep.synth.archs import ARCHS
from moeprep.synth.model import synth_config
from moeprep.synth.parts import model_metadata, model_tensors
from moeprep.synth.tokenizer import load_vocab, vocab_metadata

Q = GGMLQuantizationType
ARCH = "qwen3moe"
F16_NAME = "bench-qwen3moe-f16.gguf"
QUANT_NAME = "bench-qwen3moe-q4k.gguf"
BENCH_KEY_PREFIX = "moeprep.bench."

# train.py parameter name -> GGUF tensor name (first match wins).
NAME_MAP: list[tuple[str, str]] = [
    (r"embed", "token_embd.weight"),
    (r"output_norm", "output_norm.weight"),
    (r"layers\.(\d+)\.attn_norm", r"blk.\1.attn_norm.weight"),
    (r"layers\.(\d+)\.ffn_norm", r"blk.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.attn\.wq", r"blk.\1.attn_q.weight"),
    (r"layers\.(\d+)\.attn\.wk", r"blk.\1.attn_k.weight"),
    (r"layers\.(\d+)\.attn\.wv", r"blk.\1.attn_v.weight"),
    (r"layers\.(\d+)\.attn\.wo", r"blk.\1.attn_output.weight"),
    (r"layers\.(\d+)\.attn\.q_norm", r"blk.\1.attn_q_norm.weight"),
    (r"layers\.(\d+)\.attn\.k_norm", r"blk.\1.attn_k_norm.weight"),
    (r"layers\.(\d+)\.moe\.router", r"blk.\1.ffn_gate_inp.weight"),
    (r"layers\.(\d+)\.moe\.gate", r"blk.\1.ffn_gate_exps.weight"),
    (r"layers\.(\d+)\.moe\.up", r"blk.\1.ffn_up_exps.weight"),
    (r"layers\.(\d+)\.moe\.down", r"blk.\1.ffn_down_exps.weight"),
]
# The quantized variant's type per tensor role; roles not listed are copied from the master.
VARIANT_TYPES: dict[TensorRole, GGMLQuantizationType] = {
    TensorRole.EMBEDDING: Q.Q6_K,
    TensorRole.ATTENTION: Q.Q8_0,
    TensorRole.EXPERT: Q.Q4_K,
}


def gguf_name(param: str) -> str:
    for pattern, repl in NAME_MAP:
        if re.fullmatch(pattern, param):
            return re.sub(pattern, repl, param)
    raise KeyError(f"no GGUF name for parameter {param}")


def bench_synth_config(args: ModelArgs):
    """The synthetic generator's config with the bench model's sizes (for tensor names and metadata keys)."""
    return synth_config(
        ARCH,
        preset="tiny",
        n_layer=args.n_layers,
        n_embd=args.dim,
        n_head=args.n_heads,
        n_head_kv=args.n_kv_heads,
        head_dim=args.head_dim,
        n_expert=args.n_experts,
        n_expert_used=args.n_experts_used,
        n_ff_exp=args.expert_dim,
        n_ctx=args.context,
        rope_freq_base=args.rope_theta,
        rms_eps=args.norm_eps,
    )


def write_f16(
    state: dict[str, torch.Tensor], args: ModelArgs, tokenizer: Path, out: Path, provenance: dict[str, KVValue]
) -> Path:
    """The F16 master: matrices F16, vectors and routers F32, in the synthetic generator's tensor order."""
    tensors = {gguf_name(k): v for k, v in state.items()}
    c = bench_synth_config(args)
    vocab = load_vocab(tokenizer)
    assert vocab.size == args.vocab_size, (vocab.size, args.vocab_size)
    # the output head is tied: no output.weight, so llama.cpp and moerun both reuse token_embd
    specs = [s for s in model_tensors(ARCHS[ARCH], c, vocab.size) if s.name != "output.weight"]
    assert {s.name for s in specs} == set(tensors), {s.name for s in specs} ^ set(tensors)
    writer = GGUFWriter(path=None, arch=ARCH)
    metadata = (
        {
            Keys.General.NAME: KVValue("moeprep bench qwen3moe 22M", GGUFValueType.STRING),
            Keys.General.FILE_TYPE: KVValue(int(LlamaFileType.MOSTLY_F16), GGUFValueType.UINT32),
        }
        | model_metadata(ARCHS[ARCH], c)
        | vocab_metadata(vocab)
        | provenance
    )
    for key, kv in metadata.items():
        writer.add_key_value(key, kv.value, kv.vtype, kv.sub_type)
    for spec in specs:
        value = tensors[spec.name].float().numpy()
        assert value.shape == tuple(spec.shape), (spec.name, value.shape, spec.shape)
        keep_f32 = value.ndim == 1 or spec.name.endswith("ffn_gate_inp.weight")
        writer.add_tensor(spec.name, value.astype(np.float32 if keep_f32 else np.float16))
    with atomic_outputs([out]) as (tmp,):
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def quantized_tensor(model: GGUFModel, t: TensorInfo, target: GGMLQuantizationType) -> OutputTensor:
    """t requantized to target (or llama-quantize's fallback for its row length), one expert at a time."""
    qtype, _ = choose_type(target, t.row_length)

    def chunks():
        values = model.dequantize(t).reshape(-1, *t.shape[-2:]) if len(t.shape) == 3 else [model.dequantize(t)]
        for block in values:
            yield quantize_rows(np.asarray(block, dtype=np.float32), qtype)

    return OutputTensor(t.name, qtype, t.shape, chunks)


def write_variant(master: Path, out: Path) -> Path:
    """The Q8_0-attention / Q4_K-experts variant of the master, through moeprep's writer."""
    model = open_gguf(master)
    roles, _ = role_table(model.arch)
    tensors = []
    for t in model.tensors:
        target = VARIANT_TYPES.get(tensor_role(t.name, roles))
        tensors.append(quantized_tensor(model, t, target) if target else copied_tensor(model, t))
    kv = {
        Keys.General.FILE_TYPE: KVValue(int(LlamaFileType.MOSTLY_Q4_K_M), GGUFValueType.UINT32),
        Keys.General.QUANTIZATION_VERSION: KVValue(2, GGUFValueType.UINT32),
    }
    write_gguf(out, model, tensors=tensors, kv_set=kv)
    return out


def main() -> None:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", type=Path, required=True, help="train.py's output folder")
    p.add_argument("--tokenizer", type=Path, default=here / "work" / "tokenizer.json")
    p.add_argument("--out", type=Path, default=here.parent / "models")
    a = p.parse_args()
    config = json.loads((a.weights / "config.json").read_text())
    args = ModelArgs(**config["model"])
    log = [json.loads(line) for line in (a.weights / "train-log.jsonl").read_text().splitlines()]
    heldout = [r["heldout_loss"] for r in log if "heldout_loss" in r]
    done = next(r for r in log if r.get("event") == "done")
    S, U32, F32 = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32
    provenance = {
        BENCH_KEY_PREFIX + "train_steps": KVValue(done["steps"], U32),
        BENCH_KEY_PREFIX + "train_config": KVValue(json.dumps(config["train"], sort_keys=True), S),
        BENCH_KEY_PREFIX + "heldout_loss": KVValue(float(heldout[-1]), F32),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    master = write_f16(load_shards(a.weights), args, a.tokenizer, a.out / F16_NAME, provenance)
    variant = write_variant(master, a.out / QUANT_NAME)
    for path in (master, variant):
        print(f"{path}: {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
