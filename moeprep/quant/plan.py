"""Decide, for every tensor, whether it is copied or requantized and to what: a pure function of the model.

Rules, in order (the first that applies decides):
1. routed experts are copied byte for byte (the point of moeprep: the expert cache keeps their original bytes);
2. routers, norms, every 1-D tensor (biases, sinks, scales) and every tensor llama.cpp's quantizer never requantizes
   (roles.quant_limit: the name rules of its tensor_allows_quantization, the shared ones such as convolutions and
   norms and an architecture's own such as glm5-next's hyper-connections, indexer and KDA gates) are never touched;
3. a `--type REGEX=TYPE` rule whose regex matches the tensor name (first match wins);
4. attention tensors (the role table of moeprep/gguf/arch_table.py says which) become the `--attn` type, or Q8_0
   where llama.cpp keeps them at Q8_0 or better (glm5-next's attn_q_a/attn_q_b; a rule naming them overrides that,
   as llama.cpp's --tensor-type does);
5. everything else is copied.
A tensor already in its target type is copied (requantizing Q4_K to Q4_K only adds error). A target type whose block
does not divide the row length falls back as llama-quantize does (registry.choose_type).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import classify_tensors
from moeprep.gguf.reader import GGUFModel, TensorInfo
from moeprep.gguf.roles import QuantLimit, TensorRole, quant_limit
from moeprep.quant.registry import QUANTIZERS, choose_type

NEVER_TOUCHED = {TensorRole.EXPERT: "routed expert", TensorRole.ROUTER: "router", TensorRole.NORM: "norm"}
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


@dataclass(frozen=True)
class TypeRule:
    """`--type REGEX=TYPE`: tensors whose name matches REGEX (re.search) become TYPE."""

    pattern: re.Pattern[str]
    qtype: GGMLQuantizationType

    @property
    def text(self) -> str:
        return f"{self.pattern.pattern}={self.qtype.name}"


@dataclass(frozen=True)
class TensorPlan:
    tensor: TensorInfo
    role: TensorRole
    new_type: GGMLQuantizationType
    reason: str  # why this type, for the plan table and the summary
    fell_back_from: GGMLQuantizationType | None = None

    @property
    def requantize(self) -> bool:
        return self.new_type != self.tensor.ggml_type

    @property
    def new_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.new_type]
        return self.tensor.n_elements // block * type_size


@dataclass
class QuantPlan:
    tensors: list[TensorPlan]
    attn_type: GGMLQuantizationType
    rules: list[TypeRule] = field(default_factory=list)

    @property
    def changed(self) -> list[TensorPlan]:
        return [p for p in self.tensors if p.requantize]

    @property
    def bytes_before(self) -> int:
        return sum(p.tensor.n_bytes for p in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(p.new_bytes for p in self.tensors)


def parse_type(name: str) -> GGMLQuantizationType:
    """'q4_k' -> Q4_K, only for types we can quantize to."""
    try:
        qtype = GGMLQuantizationType[name.upper()]
    except KeyError:
        qtype = None
    if qtype not in QUANTIZERS:
        known = ", ".join(t.name for t in QUANTIZERS)
        raise MoeprepError(f"{name!r}: not a type moeprep quantizes to; choose one of {known}")
    return qtype


def parse_rule(text: str) -> TypeRule:
    """'ffn_.*_shexp=Q8_0' -> TypeRule."""
    pattern, sep, type_name = text.rpartition("=")
    if not sep or not pattern:
        raise MoeprepError(f"--type {text!r}: write it as REGEX=TYPE, for example 'ffn_.*_shexp=Q8_0'")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise MoeprepError(f"--type {text!r}: bad regular expression ({e})") from e
    return TypeRule(compiled, parse_type(type_name))


def _plan_tensor(
    t: TensorInfo, role: TensorRole, limit: QuantLimit | None, attn_type: GGMLQuantizationType, rules: list[TypeRule]
) -> TensorPlan:
    if role in NEVER_TOUCHED:
        return TensorPlan(t, role, t.ggml_type, f"{NEVER_TOUCHED[role]}: copied")
    if len(t.shape) == 1:
        return TensorPlan(t, role, t.ggml_type, "1-D: copied")
    if limit == QuantLimit.KEEP:
        return TensorPlan(t, role, t.ggml_type, "llama.cpp never requantizes it: copied")
    rule = next((r for r in rules if r.pattern.search(t.name)), None)
    if rule is not None:
        target, why = rule.qtype, f"--type {rule.text}"
    elif role == TensorRole.ATTENTION and limit == QuantLimit.Q8_0_FLOOR and attn_type not in FLOAT_TYPES:
        target, why = GGMLQuantizationType.Q8_0, "attention kept at Q8_0 or better, as llama.cpp keeps it"
    elif role == TensorRole.ATTENTION:
        target, why = attn_type, "attention"
    else:
        return TensorPlan(t, role, t.ggml_type, f"{role.value}: copied")
    chosen, fell_back = choose_type(target, t.row_length)
    if chosen == t.ggml_type:
        return TensorPlan(t, role, chosen, f"{why}: already {chosen.name}, copied")
    if fell_back:
        return TensorPlan(
            t,
            role,
            chosen,
            f"{why}: row {t.row_length} not a multiple of "
            f"{GGML_QUANT_SIZES[target][0]}, {target.name} -> {chosen.name}",
            fell_back_from=target,
        )
    return TensorPlan(t, role, chosen, why)


def plan_requant(model: GGUFModel, attn_type: GGMLQuantizationType, rules: list[TypeRule] = ()) -> QuantPlan:
    """The plan for every tensor of `model`, in file order."""
    rules = list(rules)
    roles, _ = classify_tensors(model)
    return QuantPlan(
        [_plan_tensor(t, role, quant_limit(model.arch, t.name), attn_type, rules) for t, role in roles],
        attn_type,
        rules,
    )


def format_plan(plan: QuantPlan) -> str:
    """One line per tensor (old and new type and bytes, why), then the totals: what --dry-run prints."""
    lines = [f"{'tensor':<36}{'role':<14}{'from':>6} -> {'to':<6}{'bytes before':>14}{'after':>14}  why"]
    for p in plan.tensors:
        lines.append(
            f"{p.tensor.name:<36}{p.role.value:<14}{p.tensor.type_name:>6} -> {p.new_type.name:<6}"
            f"{p.tensor.n_bytes:>14}{p.new_bytes:>14}  {p.reason}"
        )
    lines.append(
        f"{len(plan.changed)} of {len(plan.tensors)} tensors requantized; "
        f"{plan.bytes_before} -> {plan.bytes_after} bytes ({plan.bytes_after / plan.bytes_before:.1%})"
    )
    return "\n".join(lines)
