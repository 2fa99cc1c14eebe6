"""The VRAM-filling expert cache: routed experts stay in host RAM, each layer's share of free VRAM holds some of them
as GGUF bytes in slots, the GPU computes the cached experts while the CPU computes the missed ones, and a policy
decides between steps which misses earn an upload.

Pieces, each with one job: `CacheConfig` (what the user asked for), `ExpertCache` (the state all layers share: the
policy, the copy stream, hit and upload counts), `CachedExperts` (one layer's ExpertCompute: its slot banks on the
device, its experts' bytes on the host). The slot of each expert lives on the host (`slot_of`), because the CPU
needs the step's routing anyway to compute the misses: one small device-to-host copy per layer and step carries the
router's choice, the hit/miss split is a numpy lookup, and the GPU gets its slot table with the launch. Nothing in
the forward writes a slot another kernel may still read: uploads run on a copy stream after the layer's kernels, and
the layer's next launch waits for them.

Layers, the KV cache and the routers stay on the GPU (runtime/models); only the routed experts move.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import describe_model
from moeprep.gguf.reader import GGUFModel
from moeprep.units import format_size
from moeprep.profile.export import EXPERT_USAGE_KEY
from moerun.cache.placement import Placement, place
from moerun.cache.policy import DEFAULT_POLICY, make_policy
from moerun.hooks import Hooks
from moerun.kernels.cpu_experts import ExpertBytes, moe_rows
from moerun.layers import ACTIVATIONS

PARTS = ("gate", "up", "down")
# Uploads one layer may start per step: an upload of a 30B-shaped expert (2.6 MB) takes ~50 us over pinned PCIe,
# so a handful per layer keeps a step's upload time below its compute while the cache adapts within a few tokens.
UPLOADS_PER_LAYER_STEP = 2


@dataclass
class CacheConfig:
    """What the user asked of the cache: a budget per GPU (bytes; None: the GPU's free memory) or a fixed number of
    slots per MoE layer; a profile to warm from (--expert-profile; without one, counts baked into the GGUF); the
    policy. `usage` [L, E] is resolved from the profile or the GGUF by `open_cache`."""

    budgets: list[int] | None = None
    slots_per_layer: int | None = None
    profile: str | None = None
    usage: np.ndarray | None = None
    policy: str = DEFAULT_POLICY
    uploads_per_layer_step: int = UPLOADS_PER_LAYER_STEP
    cpu_threads: int | None = None


@dataclass
class CacheStats:
    """Counts since the last reset: lookups and hits per layer, uploads, decode steps."""

    lookups: np.ndarray
    hits: np.ndarray
    uploads: int = 0
    steps: int = 0

    @property
    def hit_rate(self) -> float:
        return float(self.hits.sum() / max(1, self.lookups.sum()))

    def per_layer(self) -> np.ndarray:
        return np.divide(self.hits, self.lookups, out=np.zeros(len(self.hits)), where=self.lookups > 0)


@dataclass
class ExpertCache:
    """What the cached layers share: the policy (one row per block), the copy stream, the statistics."""

    placement: Placement
    n_expert: int
    top_k: int
    devices: tuple[torch.device, ...]  # [G] the device of each budget (CPU stand-ins may repeat "cpu")
    config: CacheConfig
    stats: CacheStats = field(init=False)

    def __post_init__(self) -> None:
        n_layer = len(self.placement.slots)
        self.policy = make_policy(self.config.policy, list(self.placement.slots), self.n_expert, self.top_k)
        if self.config.usage is not None:
            self.policy.seed(self.config.usage)
        self.copy_streams = {d: torch.cuda.Stream(d) for d in self.devices if d.type == "cuda"}  # one per GPU
        self.reset_stats(n_layer)

    def device_of(self, layer: int) -> torch.device:
        """The device the placement gave `layer` (its slots, and the whole block: see moerun.devices)."""
        return self.devices[self.placement.device[layer]]

    def reset_stats(self, n_layer: int | None = None) -> None:
        n = n_layer if n_layer is not None else len(self.stats.hits)
        self.stats = CacheStats(np.zeros(n, np.int64), np.zeros(n, np.int64))


class CachedExperts(nn.Module):
    """One layer's routed experts through the cache (an ExpertCompute). Slots: `banks` (gate, up, down), each
    (n_slots, rows, row bytes) uint8 on the device; `resident[s]` is the expert in slot s (-1: empty) and
    `slot_of[e]` its inverse."""

    def __init__(self, layer: int, host: tuple[ExpertBytes, ExpertBytes, ExpertBytes], n_slots: int,
                 activation: str, cache: ExpertCache, hooks: Hooks) -> None:
        super().__init__()
        from moerun.kernels.gguf_matmul import QWeight  # Triton: present where CUDA is (and in the test extra)

        self.layer, self.host, self.cache, self.hooks = layer, host, cache, hooks
        self.activation, self.act = activation, ACTIVATIONS[activation]
        device = cache.device_of(layer)
        self.copy_stream = cache.copy_streams.get(device)  # uploads into this layer's slots
        self.banks = tuple(QWeight(torch.empty(n_slots, t.rows, t.data.shape[-1], dtype=torch.uint8, device=device),
                                   t.qtype, t.rows, t.cols) for t in host)
        self.biases = tuple(None if t.bias is None else torch.from_numpy(t.bias).to(device) for t in host)
        self.resident = np.full(n_slots, -1, np.int64)
        self.slot_of = np.full(host[0].data.shape[0], -1, np.int32)
        self.uploaded = None  # the copy stream's event after this layer's last uploads

    @classmethod
    def for_layer(cls, g: GGUFModel, layer: int, cache: ExpertCache, hooks: Hooks, activation: str) -> CachedExperts:
        """The layer's experts with the slots the placement gave it, warmed with the hottest known experts."""
        experts = cls(layer, host_experts(g, layer), cache.placement.slots[layer], activation, cache, hooks)
        experts.fill(warm_experts(cache.config.usage, layer, cache.n_expert))
        return experts

    @property
    def n_slots(self) -> int:
        return len(self.resident)

    def fill(self, experts: np.ndarray) -> None:
        """Load `experts` into the first slots (warm start, before the first token)."""
        for slot, e in enumerate(experts[: self.n_slots].tolist()):
            self._upload(slot, e)
        self._uploads_done()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from moerun.quantized import bank_moe

        if self.hooks.activation:
            raise MoeprepError("activation hooks (imatrix collection) need the model loaded without the expert cache")
        routing = torch.cat([ids.to(weights.dtype), weights], dim=1).cpu().numpy()  # the one sync of the layer
        k = ids.shape[1]
        ids_h, weights_h = routing[:, :k].astype(np.int64), np.ascontiguousarray(routing[:, k:], np.float32)
        slots_h = self.slot_of[ids_h]  # (T, K), -1 = miss
        missed = slots_h < 0
        on_gpu = x.device.type == "cuda"
        if missed.any():  # the CPU's input is enqueued before the GPU's expert kernels, so it need not wait for them
            x_host = x.to("cpu", non_blocking=on_gpu)
            x_ready = torch.cuda.Event() if on_gpu else None
            if x_ready is not None:
                x_ready.record()
        if on_gpu and self.uploaded is not None:
            torch.cuda.current_stream().wait_event(self.uploaded)
        out = bank_moe(x, torch.from_numpy(slots_h).to(x.device), weights, self.banks, self.act, self.biases, ids)
        if missed.any():
            if x_ready is not None:
                x_ready.synchronize()
            cpu_out = np.zeros((x.shape[0], x.shape[1]), np.float32)
            moe_rows(x_host.float().numpy(), np.where(missed, ids_h, -1), weights_h, *self.host, self.activation,
                     cpu_out, self.cache.config.cpu_threads)
            out = out + torch.from_numpy(cpu_out).to(x.device, non_blocking=True)
        self._account(ids_h, missed)
        return out

    def _account(self, ids_h: np.ndarray, missed: np.ndarray) -> None:
        """Count the lookups, tell the policy, start the uploads it plans."""
        stats, policy = self.cache.stats, self.cache.policy
        stats.lookups[self.layer] += missed.size
        stats.hits[self.layer] += int((~missed).sum())
        policy.observe(self.layer, ids_h)
        plan = policy.plan(self.layer, self.resident, self.cache.config.uploads_per_layer_step)
        if plan:
            stream = self.copy_stream
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())  # no kernel still reads a slot being replaced
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for slot, expert in plan:
                    self._upload(slot, expert)
            self._uploads_done()
            stats.uploads += len(plan)

    def _upload(self, slot: int, expert: int) -> None:
        old = self.resident[slot]
        if old >= 0:
            self.slot_of[old] = -1
        for bank, t in zip(self.banks, self.host):
            bank.data[slot].copy_(torch.from_numpy(t.data[expert]), non_blocking=True)
        self.resident[slot], self.slot_of[expert] = expert, slot

    def _uploads_done(self) -> None:
        if self.copy_stream is not None:
            self.uploaded = torch.cuda.Event()
            self.uploaded.record(self.copy_stream)


def host_experts(g: GGUFModel, layer: int) -> tuple[ExpertBytes, ExpertBytes, ExpertBytes]:
    """A layer's gate, up and down expert tensors as host bytes (the memory map) with their biases."""
    from moerun.weights import dequantize_bytes

    infos = {t.name: t for t in g.tensors}
    parts = []
    for part in PARTS:
        info = infos[f"blk.{layer}.ffn_{part}_exps.weight"]
        n_expert, rows, cols = info.shape
        bias = infos.get(f"blk.{layer}.ffn_{part}_exps.bias")
        bias_values = None if bias is None else dequantize_bytes(g.raw(bias), bias.ggml_type, bias.shape).numpy()
        parts.append(ExpertBytes(g.raw(info).reshape(n_expert, rows, -1), info.ggml_type, rows, cols, bias_values))
    return tuple(parts)


def warm_experts(usage: np.ndarray | None, layer: int, n_expert: int) -> np.ndarray:
    """A layer's experts hottest first by the warm-start counts (none without counts: the cache starts empty)."""
    if usage is None or usage[layer].sum() == 0:
        return np.zeros(0, np.int64)
    return np.argsort(-usage[layer], kind="stable")


def expert_usage(g: GGUFModel, profile_path: str | None, n_layer: int) -> np.ndarray | None:
    """Warm-start counts [L, E]: from a profile of this very model, else from the GGUF's baked counts, else None.
    A profile of another model is refused."""
    if profile_path is not None:
        from moeprep.profile.format import read_profile
        from moeprep.profile.identity import check_same_model, identify_model

        profile = read_profile(profile_path)
        check_same_model(profile.model, identify_model(g), profile_path, str(g.path))
        return profile.counts.block_table(n_layer)
    baked = g.get(EXPERT_USAGE_KEY)
    if baked is None:
        return None
    table = np.asarray(baked, np.int64)
    if table.size % n_layer:
        raise MoeprepError(f"{g.path}: {EXPERT_USAGE_KEY} holds {table.size} counts, not a multiple of {n_layer} layers")
    return table.reshape(n_layer, -1)



def open_cache(g: GGUFModel, config: CacheConfig, n_layer: int, top_k: int,
               devices: list[torch.device] | torch.device) -> ExpertCache:
    """Resolve the warm-start counts, place the slots in the budgets (one per device; moerun.devices resolves
    them), and make the shared cache state."""
    devices = [devices] if isinstance(devices, torch.device) else list(devices)
    device = devices[0]
    if config.usage is None:
        config = replace(config, usage=expert_usage(g, config.profile, n_layer))
    budgets = config.budgets
    if budgets is None:
        if device.type != "cuda":
            raise MoeprepError("the expert cache on a CPU device needs an explicit budget (--vram-budget)")
        budgets = [torch.cuda.mem_get_info(d)[0] for d in devices]
    assert len(budgets) == len(devices), (budgets, devices)
    placement = place(describe_model(g), budgets, usage=config.usage)
    if config.slots_per_layer is not None:
        n_expert = placement.n_expert
        slots = tuple(min(config.slots_per_layer, n_expert) if s else 0 for s in placement.slots)
        placement = replace(placement, slots=slots)
    return ExpertCache(placement, placement.n_expert, top_k, tuple(devices), config)


def describe_cache(cache: ExpertCache) -> str:
    """What moerun prints at start: slots per layer and the share of all experts they hold."""
    p = cache.placement
    warm = "warmed from the profile's counts" if cache.config.usage is not None else "starting empty"
    return (f"{p.describe()}\n  policy {cache.config.policy}, {warm}; budget "
            f"{', '.join(format_size(b) for b in p.budgets)}")
