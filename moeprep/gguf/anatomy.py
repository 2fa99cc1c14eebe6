"""Model anatomy: geometry (layers, experts, expert size), bytes per tensor role, and expert-cache slots in VRAM.

Everything here comes from tensor headers and metadata; no tensor data is read. `moeprep inspect` prints it, for
a dense model too (no expert rows, nothing to cache); commands that need experts call `moe_geometry`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo
from moeprep.gguf.roles import (
    TensorRole,
    attention_kinds,
    block_mixers,
    parse_tensor_name,
    role_table,
    tensor_role,
    window_kinds,
)
from moeprep.units import format_size

# Per-GPU memory kept back for the CUDA context, KV cache and activations when counting cache slots.
DEFAULT_RESERVE = 1536 << 20
NOT_MOE = "no routed-expert tensors (*_exps); this is not a Mixture-of-Experts model"
NO_CACHE = "a dense model: no routed experts, so there is no expert cache to plan"


@dataclass
class ModelGeometry:
    arch: str
    n_layer: int
    moe_layers: list[int]
    dense_layers: list[int]
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # hidden size of one routed expert
    expert_bytes: dict[int, int]  # MoE block index -> bytes of one expert (all its *_exps tensors, stored types)
    # hybrids: blocks by token mixer (glm5-next's KDA/DSA from its metadata, others' from their tensors: Mamba...)
    attention: dict[str, list[int]] = field(default_factory=dict)
    # the trailing NextN (multi-token prediction) blocks: loaded by no decoder, so in neither list above and given
    # no cache slots, although their *_exps tensors are routed experts by role
    nextn_layers: list[int] = field(default_factory=list)
    # the decoder's blocks by how far back they attend, where they differ: {"sliding 4096": [...], "full": [...]}
    windows: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)


@dataclass
class RoleSummary:
    n_tensors: int = 0
    n_bytes: int = 0
    types: dict[str, int] = field(default_factory=dict)  # tensor type name -> tensor count


@dataclass
class Anatomy:
    name: str
    arch: str
    arch_known: bool  # False: the architecture has no role table and names were matched by pattern
    file_size: int
    n_shards: int
    geometry: ModelGeometry
    roles: dict[str, RoleSummary]
    expert_share: float  # routed-expert bytes / file size
    nextn_non_expert: int = 0  # bytes of the NextN blocks' tensors other than their experts (no decoder loads them)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuSlots:
    vram: int
    non_expert: int  # this GPU's share of the non-expert weights
    reserve: int
    free: int
    slots_per_layer: int


@dataclass
class VramPlan:
    gpus: list[GpuSlots]
    slot_bytes: int  # one cache slot in every MoE layer
    slots_per_layer: int  # over all GPUs, at most n_expert
    n_expert: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify_tensors(model: GGUFModel) -> tuple[list[tuple[TensorInfo, TensorRole]], bool]:
    """Every tensor with its role, and whether the architecture's own table was used."""
    table, known = role_table(model.arch)
    return [(t, tensor_role(t.name, table)) for t in model.tensors], known


def _arch_int(model: GGUFModel, key: str) -> int | None:
    value = model.get(f"{model.arch}.{key}")
    return None if value is None else int(value)


def nextn_blocks(model: GGUFModel, n_layer: int) -> list[int]:
    """The last `nextn_predict_layers` blocks: multi-token prediction, skipped by the decoder (llama.cpp, moerun)."""
    return list(range(n_layer - (_arch_int(model, "nextn_predict_layers") or 0), n_layer))


def model_geometry(model: GGUFModel) -> ModelGeometry:
    """Layers, which of them are MoE, expert counts and the bytes of one expert per MoE layer (a dense model: no
    MoE layers, no experts). NextN blocks are neither MoE nor dense layers: no decoder runs them."""
    roles, _ = classify_tensors(model)
    experts = [t for t, role in roles if role == TensorRole.EXPERT]
    blocks = {parse_tensor_name(t.name).block for t in model.tensors} - {None}
    n_layer = _arch_int(model, "block_count") or (max(blocks) + 1 if blocks else 0)
    n_expert = _arch_int(model, "expert_count") or (experts[0].shape[0] if experts else 0)
    n_used = _arch_int(model, "expert_used_count") or 0
    per_block: Counter[int] = Counter()
    for t in experts:
        per_block[parse_tensor_name(t.name).block] += t.n_bytes
    down = next((t for t in experts if parse_tensor_name(t.name).base == "ffn_down_exps"), None)
    n_ff_exp = _arch_int(model, "expert_feed_forward_length") or (down.shape[-1] if down else 0)
    nextn = nextn_blocks(model, n_layer)
    moe_layers = sorted(b for b in per_block if b is not None and b not in nextn)
    return ModelGeometry(
        arch=model.arch,
        n_layer=n_layer,
        moe_layers=moe_layers,
        dense_layers=[i for i in range(n_layer) if i not in per_block and i not in nextn],
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        expert_bytes={b: per_block[b] // n_expert for b in moe_layers},
        attention=attention_kinds(model.arch, model.kv) or block_mixers([t.name for t in model.tensors], n_layer),
        nextn_layers=nextn,
        windows=window_kinds(model.arch, model.kv, n_layer - len(nextn)),
    )


def moe_geometry(model: GGUFModel) -> ModelGeometry:
    """model_geometry for what needs experts (profiles, publishing): a dense model is refused."""
    geo = model_geometry(model)
    if not geo.is_moe:
        raise MoeprepError(f"{model.path}: {NOT_MOE}")
    return geo


def describe_model(model: GGUFModel) -> Anatomy:
    roles, known = classify_tensors(model)
    summaries: dict[str, RoleSummary] = {}
    for t, role in roles:
        s = summaries.setdefault(role.value, RoleSummary())
        s.n_tensors += 1
        s.n_bytes += t.n_bytes
        s.types[t.type_name] = s.types.get(t.type_name, 0) + 1
    file_size = model.file_size
    expert_bytes = summaries.get(TensorRole.EXPERT.value, RoleSummary()).n_bytes
    geo = model_geometry(model)
    nextn = set(geo.nextn_layers)
    return Anatomy(
        name=model.name,
        arch=model.arch,
        arch_known=known,
        file_size=file_size,
        n_shards=len(model.shard_paths),
        geometry=geo,
        roles=summaries,
        expert_share=expert_bytes / file_size,
        nextn_non_expert=sum(
            t.n_bytes for t, role in roles if role != TensorRole.EXPERT and parse_tensor_name(t.name).block in nextn
        ),
    )


def plan_vram(anatomy: Anatomy, vram: list[int], reserve: int = DEFAULT_RESERVE) -> VramPlan | None:
    """Expert-cache slots per MoE layer that fit on each GPU; None for a dense model, which has nothing to cache.

    The non-expert weights (attention, norms, embeddings, shared experts...) are spread over the GPUs in proportion
    to their memory, as a layer split would; each GPU keeps `reserve` back; what is left holds cache slots, one
    slot being one expert in every MoE layer (the cache gives each layer the same number of slots). NextN blocks
    are left out: no decoder loads them, neither their experts nor the rest.
    """
    geo = anatomy.geometry
    if not geo.is_moe:
        return None
    non_expert = (
        sum(s.n_bytes for role, s in anatomy.roles.items() if role != TensorRole.EXPERT.value)
        - anatomy.nextn_non_expert
    )
    slot_bytes = sum(geo.expert_bytes.values())
    total_vram = sum(vram)
    gpus = []
    for v in vram:
        share = non_expert * v // total_vram
        free = max(0, v - share - reserve)
        gpus.append(
            GpuSlots(
                vram=v,
                non_expert=share,
                reserve=reserve,
                free=free,
                slots_per_layer=free // slot_bytes if slot_bytes else 0,
            )
        )
    total = min(geo.n_expert, sum(g.slots_per_layer for g in gpus))
    return VramPlan(gpus=gpus, slot_bytes=slot_bytes, slots_per_layer=total, n_expert=geo.n_expert)


def _types_text(types: dict[str, int]) -> str:
    return ", ".join(f"{name} x{n}" for name, n in sorted(types.items(), key=lambda kv: -kv[1]))


def _expert_lines(a: Anatomy) -> list[str]:
    geo = a.geometry
    if not geo.is_moe:
        return ["experts       -", "one expert    -", "all experts   -", f"note          {NO_CACHE}"]
    per_expert = " / ".join(format_size(s) for s in sorted(set(geo.expert_bytes.values())))
    return [
        f"experts       {geo.n_expert} per MoE layer, {geo.n_expert_used} used per token, expert FFN {geo.n_ff_exp}",
        f"one expert    {per_expert} per layer (gate+up+down as stored)",
        f"all experts   {format_size(a.roles[TensorRole.EXPERT.value].n_bytes)} = {a.expert_share:.1%} of the file",
    ]


def window_pattern(windows: dict[str, list[int]]) -> str:
    """The blocks' kinds as one letter each (the kind's first), shortened to its repeating unit where there is one:
    "S = sliding 128 (6 blocks), F = full (2 blocks): (SSSF) x2"."""
    letters = {block: kind[0].upper() for kind, blocks in windows.items() for block in blocks}
    sequence = "".join(letters[block] for block in sorted(letters))
    legend = ", ".join(f"{kind[0].upper()} = {kind} ({len(blocks)} blocks)" for kind, blocks in windows.items())
    n = len(sequence)
    period = next(p for p in range(1, n + 1) if all(sequence[i] == sequence[i % p] for i in range(n)))
    if n // period < 2:
        return f"{legend}: {sequence}"
    rest = sequence[n - n % period :]
    return f"{legend}: ({sequence[:period]}) x{n // period}" + (f" + {rest}" if rest else "")


def format_anatomy(a: Anatomy, plan: VramPlan | None = None) -> str:
    """The human-readable report `moeprep inspect` prints."""
    geo = a.geometry
    lines = [
        f"model         {a.name}",
        f"architecture  {a.arch}" + ("" if a.arch_known else "  (unknown: roles guessed from tensor names)"),
        f"file size     {format_size(a.file_size)} ({a.file_size} bytes, {a.n_shards} shard{'s' * (a.n_shards > 1)})",
        f"layers        {geo.n_layer} ({len(geo.moe_layers)} MoE, {len(geo.dense_layers)} dense"
        + (f": {', '.join(map(str, geo.dense_layers))}" if geo.dense_layers and geo.is_moe else "")
        + (f"; {len(geo.nextn_layers)} NextN: {', '.join(map(str, geo.nextn_layers))}" if geo.nextn_layers else "")
        + ")",
        *(
            [
                "attention     "
                + "; ".join(
                    f"{kind} x{len(blocks)}: {', '.join(map(str, blocks))}" for kind, blocks in geo.attention.items()
                )
            ]
            if geo.attention
            else []
        ),
        *([f"window        {window_pattern(geo.windows)}"] if geo.windows else []),
        *_expert_lines(a),
        "",
        f"{'role':<14}{'tensors':>8}{'bytes':>14}  types",
    ]
    for role in TensorRole:
        s = a.roles.get(role.value)
        if s is not None:
            lines.append(f"{role.value:<14}{s.n_tensors:>8}{format_size(s.n_bytes):>14}  {_types_text(s.types)}")
    if plan is not None:
        lines += [
            "",
            f"expert cache: one slot (an expert in each of {len(geo.moe_layers)} MoE layers) = "
            f"{format_size(plan.slot_bytes)}",
            f"{'gpu':<5}{'vram':>12}{'non-expert':>13}{'reserve':>12}{'free':>12}{'slots/layer':>13}",
        ]
        for i, g in enumerate(plan.gpus):
            lines.append(
                f"{i:<5}{format_size(g.vram):>12}{format_size(g.non_expert):>13}{format_size(g.reserve):>12}"
                f"{format_size(g.free):>12}{g.slots_per_layer:>13}"
            )
        lines.append(
            f"total: {plan.slots_per_layer} of {plan.n_expert} experts per MoE layer cached "
            f"({plan.slots_per_layer / plan.n_expert:.0%})"
        )
    return "\n".join(lines)
