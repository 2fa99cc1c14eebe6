"""`ExpertCache`: what every cached layer shares (the policy, a copy stream per GPU, the slot tables and routing
buffers of streamed steps, the statistics, the staging banks), and `open_cache`, which places the slots in the
budgets and makes it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import describe_model
from moeprep.gguf.reader import GGUFModel
from moeprep.gguf.roles import TensorRole
from moeprep.profile.tracefile import TraceFile
from moeprep.units import format_size
from moerun.cache.config import CacheConfig
from moerun.cache.host import host_experts, page_locked, should_pin
from moerun.cache.placement import Placement, place, slot_room, usage_rows
from moerun.cache.plan import AUTO, Plan, Shape, choose_plan, choose_policy, pinned_layers, trace_curves, usage_curve
from moerun.cache.policy import make_policy
from moerun.cache.stats import CacheStats, timed
from moerun.cache.warm import expert_usage, read_model_profile, warm_experts
from moerun.kernels.cpu.formats import ExpertBytes
from moerun.options import RuntimeOptions, process_options
from moerun.step import Step

if TYPE_CHECKING:
    from moerun.cache.experts import CachedExperts


@dataclass
class ExpertCache:
    """What the cached layers share: the policy (one row per block), the copy stream, the statistics. With
    `timing`, the GPU's expert work is bracketed by CUDA events (moerun bench)."""

    placement: Placement
    n_expert: int
    top_k: int
    devices: tuple[torch.device, ...]  # [G] the device of each budget (CPU stand-ins may repeat "cpu")
    config: CacheConfig
    timing: bool = False
    options: RuntimeOptions = field(default_factory=process_options)  # which devices stage and stream
    plan: Plan | None = None  # the plan chosen at start (None: --cache-slots fixed the slots)
    why: tuple[str, ...] = ()  # the lines that say which policy and plan were chosen, and why
    stats: CacheStats = field(init=False)

    def __post_init__(self) -> None:
        n_layer = len(self.placement.slots)
        self.streamed = self.config.stream and all(streams(d, self.config.pin, self.options) for d in self.devices)
        self.ggml = self.options.ggml_library()  # whose row dots the CPU's misses run on
        self.routes = self.options.int8_routes()  # the 8-bit routes of the GPU's products
        self.policy = make_policy(self.config.policy, list(self.placement.slots), self.n_expert, self.top_k)
        if self.config.usage is not None:
            self.policy.seed(self.config.usage)
        self.copy_streams = {d: torch.cuda.Stream(d) for d in self.devices if d.type == "cuda"}  # one per GPU
        cached = [layer for layer, n in enumerate(self.placement.slots) if n]
        self.first_layer, self.last_layer = cached[0], cached[-1]
        self.pinned = frozenset(self.placement.pinned)  # every expert resident: the policy never plans them
        self._routed: list[tuple[CachedExperts, np.ndarray]] = []  # this forward's layers so far
        self.scratch: dict[tuple, tuple] = {}  # staging banks for prefill, by device and expert layout
        self.paused = False  # see pause()
        self.layers: list[CachedExperts] = []  # in order, as they are built
        self.row_of: dict[int, int] = {}  # streaming: a cached layer's row in its device's tables
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # device index -> slot tables (host, device)
        self.routing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (device, T) -> ids (dev, host)
        self.unplanned: list[tuple[CachedExperts, np.ndarray]] = []  # the last streamed step's, for the next's plan
        if self.streamed:
            self._make_tables()
        self.reset_stats(n_layer)

    def _make_tables(self) -> None:
        """Streaming's slot tables, one row per cached layer of a device: every expert "on the host" (-2 - e) until
        a slot holds it. The device's copy is what kernels read; the host's (page-locked) is where the host edits."""
        for d, device in enumerate(self.devices):
            layers = [
                layer for layer, (n, on) in enumerate(zip(self.placement.slots, self.placement.device)) if n and on == d
            ]
            if not layers:
                continue
            host = (-2 - torch.arange(self.n_expert, dtype=torch.int32)).repeat(len(layers), 1)
            if device.type == "cuda":
                host = host.pin_memory()
            self.tables[d] = host, host.to(device) if device.type == "cuda" else host
            self.row_of.update((layer, row) for row, layer in enumerate(layers))

    def table_rows(self, layer: int) -> tuple[np.ndarray, torch.Tensor]:
        """Streaming: `layer`'s slot table (E,) on the host (numpy, edited there) and on its device."""
        host, dev = self.tables[self.placement.device[layer]]
        return host[self.row_of[layer]].numpy(), dev[self.row_of[layer]]

    def publish(self) -> None:
        """Streaming: every layer's completed uploads into its table, then the tables to their devices, on the
        current stream (before the next step's kernels)."""
        for layer in self.layers:
            layer.publish()
        for host, dev in self.tables.values():
            if dev is not host:
                dev.copy_(host, non_blocking=True)

    def routing_buffers(self, d: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Streaming: where a step of n_tokens records its routing, (rows, T, K) int64 on device d and page-locked
        on the host (made before a capture, graphs.DecodeGraphs: pinned memory cannot be allocated during one)."""
        key = d, n_tokens
        if key not in self.routing:
            host, _ = self.tables[d]
            shape = (host.shape[0], n_tokens, self.top_k)
            device = self.devices[d]
            pinned = device.type == "cuda"
            buf = torch.zeros(shape, dtype=torch.int64, pin_memory=pinned)
            self.routing[key] = (buf.to(device) if pinned else buf), buf
        return self.routing[key]

    def record(self, layer: CachedExperts, ids: torch.Tensor, step: Step | None) -> None:
        """Streaming: a decode step's layer records its routing on its device; the device's last layer sends the
        step's to the host, and after the last layer of all `step_done` reads it (inside a captured step: once the
        graphs are launched)."""
        d, n_tokens = self.placement.device[layer.layer], ids.shape[0]
        dev, host = self.routing_buffers(d, n_tokens)
        dev[self.row_of[layer.layer]].copy_(ids)
        if self.row_of[layer.layer] == dev.shape[0] - 1 and dev is not host:
            host.copy_(dev, non_blocking=True)
        if layer.layer == self.last_layer:
            capture = None if step is None else step.capture
            if capture is None:
                self.step_done(n_tokens)
            else:
                capture.after(partial(self.step_done, n_tokens))

    def step_done(self, n_tokens: int) -> None:
        """Streaming, once a decode step is launched: plan the step before's uploads (the policy's batched call)
        while the GPU runs this one, then wait for this one, count each layer's hits and misses against the tables
        it ran with, and keep its routing for the next step's plan. (Planned after the wait, the policy's ~1.5-3.5
        ms per token of host work left the GPU idle: 30B shape, H200 machine.) The uploads then copy after this
        step, and its successor reads the tables with them."""
        tables = {d: host.numpy().copy() for d, (host, _) in self.tables.items()}  # as this step reads them
        self.plan_pending()
        with timed(self.stats, "router sync"):
            for d in self.tables:
                if self.devices[d].type == "cuda":
                    torch.cuda.current_stream(self.devices[d]).synchronize()
        routed = []
        for layer in self.layers:
            d, row = self.placement.device[layer.layer], self.row_of[layer.layer]
            ids_h = self.routing_buffers(d, n_tokens)[1][row].numpy().copy()  # the next step rewrites the buffer
            missed = tables[d][row][ids_h] < 0
            self.stats.lookups[layer.layer] += missed.size
            self.stats.hits[layer.layer] += missed.size - int(np.count_nonzero(missed))
            self.stats.streamed += int(np.count_nonzero(missed))
            routed.append((layer, ids_h))
        self.unplanned = [] if self.paused else routed

    def plan_pending(self) -> None:
        """The last streamed step's routing to the policy, and its uploads started (step_done)."""
        routed, self.unplanned = self.unplanned, []
        if routed:
            with timed(self.stats, "uploads"):
                self._plan(routed)

    @contextlib.contextmanager
    def pause(self):
        """Steps run inside neither teach the policy nor upload anything, and the statistics restart after: a
        server's warm-up steps on made-up tokens (graph captures, kernel compiles) must not evict the experts a
        profile warmed the cache with."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
            self._routed, self.unplanned = [], []
            self.reset_stats()

    def layer_done(self, layer: CachedExperts, ids: np.ndarray) -> None:
        """Collect a layer's routing; after the last cached layer of a forward, tell the policy the step's routing
        of every layer and start the uploads it plans, in one batched call (one call per layer cost ~0.25 ms each,
        a quarter of a 48-layer decode step)."""
        if self.paused:
            return
        if layer.layer == self.first_layer:
            self.plan_pending()  # a streamed decode step's, before this forward's
            self._routed = []
        self._routed.append((layer, ids))
        if layer.layer == self.last_layer:
            routed, self._routed = self._routed, []
            with timed(self.stats, "uploads"):
                self._plan(routed)

    def warm_order(self, layer: int) -> np.ndarray:
        """The experts a layer's slots hold before the first token: every one of a pinned layer's, else the hottest
        known (warm.py)."""
        if layer in self.pinned:
            return np.arange(self.n_expert)
        return warm_experts(self.config.usage, layer, self.n_expert)

    def _plan(self, routed: list[tuple[CachedExperts, np.ndarray]]) -> None:
        routed = [(layer, ids) for layer, ids in routed if layer.layer not in self.pinned]
        if not routed:
            return
        layers = [layer for layer, _ in routed]
        rows = np.array([layer.layer for layer in layers])
        self.policy.observe_rows(rows, np.stack([ids for _, ids in routed]))
        resident = np.full((len(layers), max(layer.n_slots for layer in layers)), -1, np.int64)
        for i, layer in enumerate(layers):
            resident[i, : layer.n_slots] = layer.resident
        slot, expert = self.policy.plan_slots(rows, resident, self.config.uploads_per_layer_step)
        for layer, slots, experts in zip(layers, slot.tolist(), expert.tolist()):
            plan = [(s, e) for s, e in zip(slots, experts) if e >= 0]
            if plan:
                layer.upload(plan)
                self.stats.uploads += len(plan)
        if self.streamed:
            self.publish()

    def staging(self, layer: CachedExperts) -> tuple:
        """The staging banks for `layer`'s expert layout on its device, made on first use and shared by all layers
        (they run one after another on the same stream): as many experts as config.stage_bytes holds, at most a layer's."""
        bank = layer.banks[0].data
        key = (bank.device, *((b.qtype, b.data.shape[1:]) for b in layer.banks))
        if key not in self.scratch:
            from moerun.kernels.qweight import QWeight

            per_expert = sum(b.data[0].numel() for b in layer.banks)
            n = max(1, min(self.n_expert, self.config.stage_bytes // per_expert))
            self.scratch[key] = tuple(
                QWeight(
                    torch.empty(n, *b.data.shape[1:], dtype=torch.uint8, device=bank.device), b.qtype, b.rows, b.cols
                )
                for b in layer.banks
            )
        return self.scratch[key]

    def device_of(self, layer: int) -> torch.device:
        """The device the placement gave `layer` (its slots, and the whole block: see moerun.devices)."""
        return self.devices[self.placement.device[layer]]

    def reset_stats(self, n_layer: int | None = None) -> None:
        n = n_layer if n_layer is not None else len(self.stats.hits)
        self.stats = CacheStats(np.zeros(n, np.int64), np.zeros(n, np.int64))

    def host_experts(self, g: GGUFModel, layer: int) -> tuple[ExpertBytes, ExpertBytes, ExpertBytes]:
        """A layer's expert bytes on the host: page-locked copies when `config.pin` (uploads then run at the bus's
        speed, asynchronously; from the pageable memory map the driver stages them through a bounce buffer and the
        host waits), else the memory map."""
        parts = host_experts(g, layer)
        if not self.config.pin:
            return parts
        readers = tuple(d for d in self.devices if d.type == "cuda")
        pinned = {}  # an ungated layer's up, given as its gate too, is pinned once
        for t in parts:
            if id(t) not in pinned:
                pinned[id(t)] = replace(t, data=page_locked(t.data, readers))
        return tuple(pinned[id(t)] for t in parts)


def streams(device: torch.device, pinned: bool | None, options: RuntimeOptions) -> bool:
    """Do decode steps on `device` read their misses from host RAM (a GPU: when the experts are page-locked, which
    the kernels can read over the bus; a CPU standing in for one computes them with the CPU's kernel as its "bus",
    where options.stream_devices says so)?"""
    return device.type in options.stream_devices and (device.type != "cuda" or bool(pinned))


def open_cache(
    g: GGUFModel,
    config: CacheConfig,
    n_layer: int,
    top_k: int,
    devices: list[torch.device] | torch.device,
    options: RuntimeOptions | None = None,
) -> ExpertCache:
    """Resolve the warm-start counts, the policy and the plan (cache/plan.py), place the slots in the budgets (one
    per device; moerun.devices resolves them), and make the shared cache state."""
    devices = [devices] if isinstance(devices, torch.device) else list(devices)
    device = devices[0]
    options = options or process_options()
    profile = None if config.profile is None else read_model_profile(g, config.profile)
    if config.usage is None:
        config = replace(config, usage=expert_usage(g, profile, n_layer))
    budgets = config.budgets
    if budgets is None:
        if device.type != "cuda":
            raise MoeprepError("the expert cache on a CPU device needs an explicit budget (--vram-budget)")
        budgets = [torch.cuda.mem_get_info(d)[0] for d in devices]
    assert len(budgets) == len(devices), (budgets, devices)
    anatomy = describe_model(g)
    placement = place(anatomy, budgets, usage=config.usage)  # refuses a dense model: it has no experts
    if config.pin is None:
        config = replace(config, pin=should_pin(anatomy.roles[TensorRole.EXPERT.value].n_bytes, device))
    if config.slots_per_layer is not None and config.plan not in (AUTO, "cache"):
        raise MoeprepError(
            f"--cache-slots {config.slots_per_layer} fixes every layer's slots: it takes the cache "
            f"plan, not --cache-plan {config.plan}; give --cache-slots auto"
        )
    geo = anatomy.geometry
    if config.slots_per_layer is not None and config.slots_per_layer > geo.n_expert:
        raise MoeprepError(
            f"--cache-slots {config.slots_per_layer}: a MoE layer of this model has {geo.n_expert} experts; give "
            f"at most {geo.n_expert} (every expert resident) or --cache-slots auto"
        )
    moe = list(geo.moe_layers)
    usage = usage_rows(config.usage, geo.n_layer, moe, geo.n_expert, len(geo.nextn_layers))  # [M, E] or None
    shape = Shape(
        len(moe), geo.n_expert, top_k, int(np.mean([geo.expert_bytes[b] for b in moe])), slot_room(anatomy, budgets)
    )
    can_stream = config.stream and all(streams(d, config.pin, options) for d in devices)
    measure = (
        ROUTING_POLICIES if config.policy == AUTO else () if config.slots_per_layer is not None else (config.policy,)
    )  # nothing to choose: no replay
    curves = routing_curves(config, profile, measure)
    if config.policy == AUTO:
        policy, why = choose_policy(curves, shape, config.bandwidths, can_stream)
    else:
        policy, why = config.policy, f"cache policy {config.policy}: as asked (--cache-policy)"
    config = replace(config, policy=policy)
    plan = None
    if config.slots_per_layer is not None:
        placement = fixed_slots(placement, config.slots_per_layer, geo.expert_bytes)
        lines = (why,)
    else:
        static = usage_curve(usage, geo.n_expert)
        curve = curves.get(policy) or replace(
            static,
            policy=policy,
            source=f"a guess: {policy} hits as the hottest set would ({static.source}); no routing measured",
        )
        plan = choose_plan(config.plan, shape, curve, static, config.bandwidths, can_stream)
        for n_pin in range(plan.pinned, 0, -1):  # several GPUs: each must hold its block's whole layers
            pins = pinned_layers(usage, n_pin, len(moe), shape.rest_share(n_pin), geo.n_expert)
            try:
                placement = place(anatomy, budgets, usage=config.usage, pinned=tuple(moe[m] for m in pins))
                break
            except MoeprepError:
                continue  # fewer; with none, the cache plan's placement stays
        config = replace(config, policy=plan.policy, stream=config.stream and plan.stream)
        lines = (why, plan.describe())
        if len(placement.pinned) != plan.pinned:
            lines += (
                f"  {len(placement.pinned)} of the plan's {plan.pinned} whole layers pinned: the GPUs' blocks "
                "hold no more",
            )
    return ExpertCache(
        placement, placement.n_expert, top_k, tuple(devices), config, options=options, plan=plan, why=lines
    )


ROUTING_POLICIES = ("lru", "lfu", "classlru", "payback", "cost-payback")  # what auto chooses among


def routing_curves(config: CacheConfig, profile, policies: tuple[str, ...]) -> dict:
    """Each policy's HitCurve measured on routing (cache/plan.py): the trace asked for (moerun bench --routing), else
    the profile's held-out chunks (all its chunks where none were held out); {} without either."""
    trace, source = config.trace, "the replayed routing trace"
    if trace is None and profile is not None and len(profile.trace.ids):
        t = profile.trace
        chunks = np.flatnonzero(t.heldout) if t.heldout.any() else np.arange(t.n_chunks)
        source = "the profile's held-out chunks" if t.heldout.any() else "the profile's chunks (none held out)"
        ids = np.concatenate([t.chunk(c) for c in chunks])
        trace = TraceFile(
            ids.astype(np.int64), np.concatenate([[0], np.cumsum(np.diff(t.starts)[chunks])]), profile.model.n_expert
        )
    if trace is None or not policies:
        return {}
    return trace_curves(trace, policies, source, free=config.uploads_per_layer_step)


def fixed_slots(placement: Placement, per_layer: int, expert_bytes) -> Placement:
    """The placement with `per_layer` slots (at most the experts: open_cache refuses more) in every MoE layer, on the
    same GPUs; refused when a GPU's budget, after its non-expert share and the reserve, cannot hold them."""
    slots = tuple(per_layer if s else 0 for s in placement.slots)
    cache = [0] * len(placement.budgets)
    for layer, n in enumerate(slots):
        if n:
            cache[placement.device[layer]] += n * expert_bytes[layer]
    for gpu, (budget, used, before, wanted) in enumerate(
        zip(placement.budgets, placement.used, placement.cache_bytes, cache)
    ):
        room = budget - (used - before)
        if wanted > room:
            raise MoeprepError(
                f"--cache-slots {per_layer}: gpu {gpu}'s slots take {format_size(wanted)}, but its "
                f"budget of {format_size(budget)} leaves {format_size(room)} for slots; give fewer "
                "slots, a larger --vram-budget, or --cache-slots auto"
            )
    used = tuple(u - b + c for u, b, c in zip(placement.used, placement.cache_bytes, cache))
    return replace(placement, slots=slots, cache_bytes=tuple(cache), used=used)


def describe_cache(cache: ExpertCache) -> str:
    """What moerun prints at start: slots per layer and the share of all experts they hold."""
    p = cache.placement
    warm = "warmed from the profile's counts" if cache.config.usage is not None else "starting empty"
    misses = (
        "decode steps read their misses from page-locked RAM (streamed)"
        if cache.streamed
        else "the CPU computes the misses"
    )
    host = "page-locked copies" if cache.config.pin else "the memory map"
    summary = (
        f"{p.describe()}\n  policy {cache.config.policy}, {warm}; budget "
        f"{', '.join(format_size(b) for b in p.budgets)}; experts uploaded from {host}; {misses}"
    )
    return "\n".join((summary, *cache.why))
