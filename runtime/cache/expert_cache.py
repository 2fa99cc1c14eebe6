"""The VRAM-filling expert cache: routed experts stay in host RAM, each layer's share of free VRAM holds some of them
as GGUF bytes in slots, the GPU computes the cached experts, the missed ones are read from host RAM over the bus (a
decode step) or computed by the CPU at the same time (a prompt), and a policy decides between steps which misses
earn an upload.

Pieces, each with one job: `CacheConfig` (what the user asked for), `ExpertCache` (the state all layers share: the
policy, a copy stream per GPU, the slot tables and routing buffers of streamed steps, the statistics, the staging
banks), `CachedExperts` (one layer's ExpertCompute: its slot banks on the device, its experts' bytes on the host,
see cache/host.py). Nothing writes a slot another kernel may still read: uploads run on a copy stream after the
step's kernels, and a slot enters the tables the kernels read only once its copy is complete.

Streaming (where the experts are page-locked on a GPU): a decode-sized step (up to tuning.GEMV_MAX_TOKENS tokens,
eager or captured) does not stop at the host. Each layer's bank names its experts in host RAM as its second bank
(QWeight.second), and a device table per layer maps every expert to its slot or, for a miss, to "expert e of the
second bank" (-2 - e). A copy kernel moves the step's missed experts from page-locked RAM into the staging bank
(44-50 GB/s on the H200 machine; staging.stage_second) and the matrix-vector kernel runs them in the same
launch as the cached ones. The step is then one CUDA graph; each layer records its routing on the device, and
after the step the host reads all layers' routing in one copy (`ExpertCache.step_done`) and counts hits, and while
the next step runs, the policy plans the uploads. The device tables change only between steps: an evicted expert
is marked "on the host" before the next step, an uploaded one becomes a slot once its copy is complete
(`CachedExperts.publish`). Measured against the CPU computing the misses (the design before, with the host
stopping at every layer): 60 GB model at 24 GiB, 46.5 -> 77.4 tok/s warm (docs/BENCHMARKS.md).

The misses of a prompt (more tokens) and of any step where the experts are not page-locked (the memory map, whose
copies run at a seventh of the speed) go to the CPU instead: the slot of each expert lives on the host too
(`slot_of`), one small device-to-host copy per layer carries the router's choice, the hit/miss split is a numpy
lookup, the GPU gets its slot table with the launch and the CPU computes the misses meanwhile; a prompt's misses
chosen by several tokens are staged on the GPU instead (`_stage`). After the last cached layer the policy sees the
whole step's routing in one call.

Eager forwards (prompts, batches) and captured decode steps (graphs.py: the step's graphs are cut around each cached
layer's host work) run the same lookups, kernels and accounting. Layers, the KV cache and the routers stay on the
GPU (runtime/models); only the routed experts move.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import describe_model
from moeprep.gguf.reader import GGUFModel
from moeprep.gguf.roles import TensorRole
from moeprep.units import format_size
from moeprep.profile.export import EXPERT_USAGE_KEY
from moerun.cache.host import host_experts, page_locked, read_only_tensor, should_pin
from moerun.cache.placement import Placement, place
from moerun.cache.policy import DEFAULT_POLICY, make_policy
from moerun.graphs import active_capture
from moerun.hooks import Hooks
from moerun.kernels.cpu_experts import ExpertBytes, moe_rows
from moerun.kernels.tuning import GEMV_MAX_TOKENS
from moerun.layers import ACTIVATIONS, swiglu_clamp

# Uploads one layer may start per step: an upload of a 30B-shaped expert (2.6 MB) takes ~50 us over pinned PCIe,
# so a handful per layer keeps a step's upload time below its compute while the cache adapts within a few tokens.
UPLOADS_PER_LAYER_STEP = 2
# Prefill: a missed expert chosen by this many of a step's tokens runs on the GPU from a staging bank. An expert of
# the 30B shape uploads in ~50 us over pinned PCIe; the CPU spends about that on each token it computes.
STAGE_MIN_TOKENS = 4
STAGE_BYTES = 512 << 20  # the staging bank's size per device (part of the VRAM reserve)
STAGING_DEVICES = {"cuda"}  # a CPU standing in for the GPU gains nothing from staging (tests turn it on)
# Streaming (module docstring): where decode-sized steps read their misses from host RAM in the experts' kernels. A
# CPU standing in for the GPU computes them with the CPU's kernel as its "bus" (tests turn it on).
STREAM_DEVICES = {"cuda"}


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
    uploads_per_layer_step: int | None = UPLOADS_PER_LAYER_STEP  # None: every upload the policy wants
    cpu_threads: int | None = None
    pin: bool | None = None  # copy the experts into page-locked RAM (None: on CUDA, when free RAM holds them)
    stream: bool = True  # decode steps read their misses from page-locked host RAM (module docstring); off: the CPU
    # computes them, as where the experts are not page-locked


@dataclass
class CacheStats:
    """Counts since the last reset: lookups and hits per layer, uploads, and where the layers' host time went
    (`seconds`: router sync, CPU experts, uploads; `gpu_events`: (start, end) CUDA events around the GPU's expert
    work, read once the device is idle)."""

    lookups: np.ndarray
    hits: np.ndarray
    uploads: int = 0
    staged: int = 0  # a prompt's experts copied to the staging bank for one step, not kept
    streamed: int = 0  # misses a decode step's kernels read from host RAM over the bus
    seconds: dict = field(default_factory=lambda: dict.fromkeys(TIMED, 0.0))
    gpu_events: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return float(self.hits.sum() / max(1, self.lookups.sum()))

    def per_layer(self) -> np.ndarray:
        return np.divide(self.hits, self.lookups, out=np.zeros(len(self.hits)), where=self.lookups > 0)

    def gpu_expert_seconds(self) -> float:
        """Device time of the GPU's expert kernels (synchronizes)."""
        if self.gpu_events:
            self.gpu_events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.gpu_events) / 1000


# Host time of the cached layers, by what it waited for or did: the router's result (the GPU's work up to it),
# the CPU's experts, planning and enqueueing uploads.
TIMED = ("router sync", "CPU experts", "uploads")


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
    stats: CacheStats = field(init=False)

    def __post_init__(self) -> None:
        n_layer = len(self.placement.slots)
        self.streamed = self.config.stream and all(streams(d, self.config.pin) for d in self.devices)
        self.policy = make_policy(self.config.policy, list(self.placement.slots), self.n_expert, self.top_k)
        if self.config.usage is not None:
            self.policy.seed(self.config.usage)
        self.copy_streams = {d: torch.cuda.Stream(d) for d in self.devices if d.type == "cuda"}  # one per GPU
        cached = [layer for layer, n in enumerate(self.placement.slots) if n]
        self.first_layer, self.last_layer = cached[0], cached[-1]
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
            layers = [layer for layer, (n, on) in enumerate(zip(self.placement.slots, self.placement.device))
                      if n and on == d]
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

    def record(self, layer: CachedExperts, ids: torch.Tensor) -> None:
        """Streaming: a decode step's layer records its routing on its device; the device's last layer sends the
        step's to the host, and after the last layer of all `step_done` reads it (inside a captured step: once the
        graphs are launched)."""
        d, n_tokens = self.placement.device[layer.layer], ids.shape[0]
        dev, host = self.routing_buffers(d, n_tokens)
        dev[self.row_of[layer.layer]].copy_(ids)
        if self.row_of[layer.layer] == dev.shape[0] - 1 and dev is not host:
            host.copy_(dev, non_blocking=True)
        if layer.layer == self.last_layer:
            capture = active_capture()
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

    def _plan(self, routed: list[tuple[CachedExperts, np.ndarray]]) -> None:
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
        (they run one after another on the same stream): as many experts as STAGE_BYTES holds, at most a layer's."""
        bank = layer.banks[0].data
        key = (bank.device, *((b.qtype, b.data.shape[1:]) for b in layer.banks))
        if key not in self.scratch:
            from moerun.kernels.qweight import QWeight

            per_expert = sum(b.data[0].numel() for b in layer.banks)
            n = max(1, min(self.n_expert, STAGE_BYTES // per_expert))
            self.scratch[key] = tuple(QWeight(torch.empty(n, *b.data.shape[1:], dtype=torch.uint8, device=bank.device),
                                              b.qtype, b.rows, b.cols) for b in layer.banks)
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
        return tuple(replace(t, data=page_locked(t.data, readers)) for t in parts)


def streams(device: torch.device, pinned: bool | None) -> bool:
    """Do decode steps on `device` read their misses from host RAM (a GPU: when the experts are page-locked, which
    the kernels can read over the bus)?"""
    return device.type in STREAM_DEVICES and (device.type != "cuda" or bool(pinned))


@contextlib.contextmanager
def timed(stats: CacheStats, what: str):
    start = time.perf_counter()
    yield
    stats.seconds[what] += time.perf_counter() - start


@dataclass
class StepBuffers:
    """A captured decode step's fixed buffers for one layer and T tokens (see graphs.py): the router's choice and
    the layer's input come to pinned host memory inside the graph; the slot table and the CPU's result go back
    between graphs."""

    routing: torch.Tensor  # (T, 2K) float32 pinned: expert ids, weights
    x: torch.Tensor  # (T, D) float32 pinned
    slots_host: torch.Tensor  # (T, K) int32 pinned
    slots: torch.Tensor  # (T, K) int32 on the device
    cpu_host: torch.Tensor  # (T, D) float32 pinned
    cpu: torch.Tensor  # (T, D) float32 on the device
    routed: tuple = ()  # this step's host ids, weights and miss mask, from the router's copy to the CPU's work
    cpu_dirty: bool = False  # `cpu` holds a nonzero sum (a step without misses must clear it)

    def __post_init__(self) -> None:  # numpy views of the pinned buffers, made once (the host steps are per layer)
        self.routing_np, self.x_np = self.routing.numpy(), self.x.numpy()
        self.slots_np, self.cpu_np = self.slots_host.numpy(), self.cpu_host.numpy()

    @classmethod
    def make(cls, T: int, K: int, D: int, device: torch.device) -> StepBuffers:
        pinned = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, pin_memory=True)  # noqa: E731
        return cls(pinned(T, 2 * K), pinned(T, D), pinned(T, K, dtype=torch.int32),
                   torch.zeros(T, K, dtype=torch.int32, device=device), pinned(T, D),
                   torch.zeros(T, D, device=device))


class CachedExperts(nn.Module):
    """One layer's routed experts through the cache (an ExpertCompute). Slots: `banks` (gate, up, down), each
    (n_slots, rows, row bytes) uint8 on the device, with the host copies as their second bank where streaming;
    `resident[s]` is the expert in slot s (-1: empty) and `slot_of[e]` its inverse, the policy's view; `table_host`
    and `table` the streamed steps' view (module docstring).

    A streamed step (`_streamed`) runs every expert on the GPU and records its routing. Otherwise, eagerly, a
    forward copies the routing to the host (the layer's one sync), launches the hits, computes the misses on the CPU
    meanwhile (a prompt's busy ones staged on the GPU, `_stage`), and sums. Inside a captured step that does not
    stream (graphs.py) the same work is split around two cuts: the graph before copies routing and input to pinned
    buffers; at the first cut the host looks the experts up and sends the slot table; the hits' kernels are a graph
    of their own; at the second cut the CPU computes the misses while the GPU runs that graph, and the next graph adds
    the CPU's result."""

    def __init__(self, layer: int, host: tuple[ExpertBytes, ExpertBytes, ExpertBytes], n_slots: int,
                 activation: str, cache: ExpertCache, hooks: Hooks, limit: float = 0.0) -> None:
        super().__init__()
        from moerun.kernels.qweight import QWeight

        self.layer, self.host, self.cache, self.hooks = layer, host, cache, hooks
        # swiglu_clamp's limit is per block (glm5-next); moe_rows takes it as an argument
        self.activation, self.limit = activation, limit
        self.act = partial(swiglu_clamp, limit=limit) if activation == "swiglu_clamp" else ACTIVATIONS[activation]
        device = cache.device_of(layer)
        self.copy_stream = cache.copy_streams.get(device)  # uploads into this layer's slots
        self.host_tensors = tuple(read_only_tensor(t.data) for t in host)
        self.banks = tuple(QWeight(torch.empty(n_slots, t.rows, t.data.shape[-1], dtype=torch.uint8,
                                               device=device), t.qtype, t.rows, t.cols,
                                   second=h if cache.streamed else None) for t, h in zip(host, self.host_tensors))
        if self.copy_stream is not None:  # freed while uploads still write them (a model dropped mid-step), the
            for bank in self.banks:  # banks' memory goes to no other tensor before those copies are done
                bank.data.record_stream(self.copy_stream)
        self.biases = tuple(None if t.bias is None else torch.from_numpy(t.bias).to(device) for t in host)
        # streaming: the slot tables (ExpertCache.table_rows) and the uploads not yet in them, with their copies' event
        self.table_host, self.table = cache.table_rows(layer) if cache.streamed else (None, None)
        self.pending: list[tuple[list[tuple[int, int]], torch.cuda.Event | None]] = []
        self.resident = np.full(n_slots, -1, np.int64)
        self.slot_of = np.full(host[0].data.shape[0], -1, np.int32)
        self.uploaded = None  # the copy stream's event after this layer's last uploads
        self.step_buffers: dict[int, StepBuffers] = {}  # a captured decode step's, by its number of tokens
        cache.layers.append(self)

    def streams(self, n_tokens: int) -> bool:
        """Does a step of n_tokens read this layer's misses from host RAM (decode-sized, with streaming on)?"""
        return self.table is not None and n_tokens <= GEMV_MAX_TOKENS

    def prepare_capture(self, n_tokens: int) -> None:
        """Make the buffers of a captured decode step of `n_tokens` (graphs.DecodeGraphs calls this before a
        capture: pinned memory cannot be allocated during one)."""
        device = self.banks[0].data.device
        if self.streams(n_tokens):
            self.cache.routing_buffers(self.cache.placement.device[self.layer], n_tokens)
        elif device.type == "cuda" and n_tokens not in self.step_buffers:
            self.step_buffers[n_tokens] = StepBuffers.make(n_tokens, self.cache.top_k, self.host[0].cols, device)

    @classmethod
    def for_layer(cls, g: GGUFModel, layer: int, cache: ExpertCache, hooks: Hooks, activation: str,
                  limit: float = 0.0) -> CachedExperts:
        """The layer's experts with the slots the placement gave it, warmed with the hottest known experts."""
        experts = cls(layer, cache.host_experts(g, layer), cache.placement.slots[layer], activation, cache, hooks,
                      limit)
        experts.fill(warm_experts(cache.config.usage, layer, cache.n_expert))
        return experts

    @property
    def n_slots(self) -> int:
        return len(self.resident)

    def fill(self, experts: np.ndarray) -> None:
        """Load `experts` into the first slots (warm start, before the first token)."""
        self.upload(list(enumerate(experts[: self.n_slots].tolist())))
        if self.table is not None:
            if self.uploaded is not None:
                self.uploaded.synchronize()  # at load: the first step finds them in place
            self.cache.publish()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.hooks.activation:
            raise MoeprepError("activation hooks (imatrix collection) need the model loaded without the expert cache")
        if self.streams(ids.shape[0]):
            out = self._streamed(x, ids, weights)
            self.cache.record(self, ids)
            return out
        capture = active_capture()
        if capture is not None:
            return self._captured(capture, x, ids, weights)
        with timed(self.cache.stats, "router sync"):
            routing = self._routing(ids, weights).cpu().numpy()  # the one sync of the layer
        ids_h, weights_h, missed = self._look_up(routing)
        on_cpu, on_gpu = missed, x.device.type == "cuda"
        if on_cpu.any():  # the CPU's input is enqueued before the GPU's expert kernels, so it need not wait for them
            x_host = x.float().to("cpu", non_blocking=on_gpu)
            x_ready = torch.cuda.Event() if on_gpu else None
            if x_ready is not None:
                x_ready.record()
        self._wait_for_copies()
        out = self._hits(x, torch.from_numpy(self.slot_of[ids_h]).to(x.device), weights, ids)
        if on_cpu.any() and x.shape[0] >= STAGE_MIN_TOKENS and x.device.type in STAGING_DEVICES:
            staged = self._stage(x, ids_h, on_cpu, weights, ids)
            if staged is not None:
                on_cpu, staged_out = staged
                out = out + staged_out
        if on_cpu.any():
            if x_ready is not None:
                x_ready.synchronize()
            out = self._add_misses(out, x_host.numpy(), ids_h, weights_h, on_cpu)
        self._account(ids_h, missed)  # the cache's hits and misses, whoever computed the misses
        return out

    def _streamed(self, x, ids, weights) -> torch.Tensor:
        """A decode-sized step: every expert in one launch, the misses from the host copies. On a GPU the misses
        are first copied to the staging bank by a copy kernel (twice the bus speed of the matrix-vector kernel's
        own loads; stage_second), where it holds all of the step's pairs (else they are read in place)."""
        slots, banks, second = self.table[ids], self.banks, None
        if x.device.type in STAGING_DEVICES:
            stage = self.cache.staging(self)
            if stage[0].data.shape[0] >= slots.numel():
                from moerun.kernels.staging import stage_second

                banks, slots = stage_second(slots, self.banks, tuple(b.data for b in stage))
                second = ids.reshape(-1)  # staging matrix p holds pair p's expert
        return self._hits(x, slots, weights, ids, banks, second=second)

    def _add_misses(self, out, x_host: np.ndarray, ids_h, weights_h, missed) -> torch.Tensor:
        """out + the CPU's sum over the missed (token, expert) pairs, computed for just the tokens that have any."""
        cpu_out = np.zeros(x_host.shape, np.float32)
        rows = np.flatnonzero(missed.any(axis=1))  # a prompt's tokens with CPU work (the others cost nothing)
        if len(rows) == len(missed):
            self._misses(x_host, ids_h, weights_h, missed, cpu_out)
        else:
            part = np.zeros((len(rows), x_host.shape[1]), np.float32)
            self._misses(x_host[rows], ids_h[rows], weights_h[rows], missed[rows], part)
            cpu_out[rows] = part
        return out + torch.from_numpy(cpu_out).to(out.device, non_blocking=True)

    def _stage(self, x, ids_h, missed, weights, ids) -> tuple[np.ndarray, torch.Tensor] | None:
        """Many tokens (a prompt): every missed expert chosen by at least STAGE_MIN_TOKENS of them is copied to a
        staging bank on the GPU and computed there (its upload costs less than the CPU's work for that many
        tokens), in rounds of as many as the bank holds; the rest stay with the CPU, which computes them while the
        rounds run. -> (the misses left to the CPU, the staged experts' sum), or None."""
        counts = np.bincount(ids_h[missed], minlength=len(self.slot_of))
        chosen = np.flatnonzero(counts >= STAGE_MIN_TOKENS)
        if not len(chosen):
            return None
        banks = self.cache.staging(self)
        capacity = banks[0].data.shape[0]
        out = None
        for first in range(0, len(chosen), capacity):  # a round's copies wait, in stream order, for the last round
            part = chosen[first : first + capacity]
            self._copy_runs(part, banks)
            stage_of = np.full(len(self.slot_of), -1, np.int32)
            stage_of[part] = np.arange(len(part))
            slots = np.where(missed, stage_of[ids_h], -1)
            in_bank = np.full(capacity, -1, np.int64)
            in_bank[: len(part)] = part
            staged = self._hits(x, torch.from_numpy(slots).to(x.device), weights, ids, banks, in_bank)
            out = staged if out is None else out + staged
        self.cache.stats.staged += len(chosen)
        return missed & (counts[ids_h] < STAGE_MIN_TOKENS), out

    def _copy_runs(self, experts: np.ndarray, banks: tuple) -> None:
        """Copy the sorted `experts` into the first slots of `banks`, a run of consecutive experts in one copy per
        tensor."""
        with timed(self.cache.stats, "uploads"):
            starts = np.flatnonzero(np.diff(experts, prepend=-2) != 1)
            for start, end in zip(starts.tolist(), [*starts[1:].tolist(), len(experts)]):
                first = int(experts[start])
                for bank, t in zip(banks, self.host_tensors):
                    bank.data[start:end].copy_(t[first : first + end - start], non_blocking=True)

    def _wait_for_copies(self) -> None:
        """The current stream waits for the copy stream's writes into this layer's slots before it runs the hits."""
        if self.uploaded is not None:
            torch.cuda.current_stream().wait_event(self.uploaded)

    @staticmethod
    def _routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """What the host reads of a step, in one tensor: (T, 2K) ids and weights."""
        return torch.cat([ids.to(torch.float32), weights.float()], dim=1)

    def _look_up(self, routing: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (T, 2K) routing on the host -> ids, weights, which of them missed."""
        k = self.cache.top_k
        ids_h, weights_h = routing[:, :k].astype(np.int64), np.ascontiguousarray(routing[:, k:], np.float32)
        return ids_h, weights_h, self.slot_of[ids_h] < 0

    def _hits(self, x, slots, weights, ids, banks=None, experts=None, second=None) -> torch.Tensor:
        """sum_k weights * expert(x) over the (t, k) whose slot in `banks` (default: the cache's) is not -1;
        experts[s]: the expert in slot s (for its biases; default: the policy's slots), and
        second[j] the expert of the second bank's matrix j (slot -2 - j; default: expert j, the host copies)."""
        if x.device.type == "cpu":
            return self._hits_on_cpu(x, slots, weights, banks or self.banks,
                                     self.resident if experts is None else experts,
                                     np.arange(len(self.slot_of)) if second is None else second.numpy())
        from moerun.quantized import bank_moe  # Triton, which CUDA builds of torch bring

        timing = self.cache.timing and active_capture() is None
        if timing:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        out = bank_moe(x, slots, weights, banks or self.banks, self.act, self.biases, ids)
        if timing:
            events[1].record()
            self.cache.stats.gpu_events.append(events)
        return out

    def _hits_on_cpu(self, x, slots, weights, banks, experts, second) -> torch.Tensor:
        """A CPU standing in for the GPU runs its slots through the CPU's own kernel (the misses' arithmetic, so
        the stand-in's output is the all-CPU model's), as if the slots were the experts; the second bank's
        (-2 - j, streamed misses) as slots after the bank's."""
        if (slots < -1).any():
            n = banks[0].data.shape[0]
            banks = tuple(replace(b, data=torch.cat([b.data, b.second])) for b in banks)
            experts = np.concatenate([experts, second])
            slots = torch.where(slots < -1, n - 2 - slots, slots)
        slot_bytes = tuple(ExpertBytes(b.data.numpy(), b.qtype, b.rows, b.cols,
                                       None if t.bias is None else t.bias[np.maximum(experts, 0)])
                           for b, t in zip(banks, self.host))
        out = np.zeros(tuple(x.shape), np.float32)
        moe_rows(x.float().numpy(), slots.numpy(), weights.float().numpy(), *slot_bytes, self.activation, out,
                 self.cache.config.cpu_threads, self.limit)
        return torch.from_numpy(out)

    def _misses(self, x: np.ndarray, ids_h, weights_h, missed, out: np.ndarray) -> None:
        with timed(self.cache.stats, "CPU experts"):
            moe_rows(x, np.where(missed, ids_h, -1), weights_h, *self.host, self.activation, out,
                     self.cache.config.cpu_threads, self.limit)

    # ---- inside a captured decode step (graphs.py): the graph's side, then the host's work at each cut

    def _captured(self, capture, x, ids, weights) -> torch.Tensor:
        buf = self.step_buffers[ids.shape[0]]  # made by prepare_capture
        buf.routing.copy_(self._routing(ids, weights), non_blocking=True)
        buf.x.copy_(x.float(), non_blocking=True)
        capture.cut(lambda: self._route_step(buf))
        out = self._hits(x, buf.slots, weights, ids)
        capture.cut(lambda: self._miss_step(buf))
        return out + buf.cpu

    def _route_step(self, buf: StepBuffers) -> None:
        """Host, after the graph that ends with the router: look up, send the slot table, let the hits wait for
        this layer's uploads."""
        with timed(self.cache.stats, "router sync"):
            torch.cuda.current_stream().synchronize()
        ids_h, weights_h, missed = self._look_up(buf.routing_np)
        buf.slots_np[:] = self.slot_of[ids_h]
        buf.slots.copy_(buf.slots_host, non_blocking=True)
        self._wait_for_copies()
        buf.routed = ids_h, weights_h, missed
        if self.cache.timing:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.cache.stats.gpu_events.append((event, None))

    def _miss_step(self, buf: StepBuffers) -> None:
        """Host, while the GPU runs the hits' graph: the misses on the CPU, their sum to the device, the policy."""
        stats = self.cache.stats
        if self.cache.timing:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            stats.gpu_events[-1] = (stats.gpu_events[-1][0], end)
        ids_h, weights_h, missed = buf.routed
        if missed.any() or buf.cpu_dirty:
            buf.cpu_np[:] = 0
            if missed.any():
                self._misses(buf.x_np, ids_h, weights_h, missed, buf.cpu_np)
            buf.cpu.copy_(buf.cpu_host, non_blocking=True)  # the pinned buffer is rewritten after the next sync
            buf.cpu_dirty = bool(missed.any())
        self._account(ids_h, missed)

    def _account(self, ids_h: np.ndarray, missed: np.ndarray) -> None:
        stats = self.cache.stats
        stats.lookups[self.layer] += missed.size
        stats.hits[self.layer] += int((~missed).sum())
        self.cache.layer_done(self, ids_h)

    def upload(self, plan: list[tuple[int, int]]) -> None:
        """Copy the planned (slot, expert) pairs in on the copy stream, once no kernel still reads those slots."""
        self.uploaded = self._on_copy_stream(lambda: [self._upload(slot, expert) for slot, expert in plan])
        if self.table is not None:
            self.pending.append((plan, self.uploaded))

    def publish(self) -> None:
        """Streaming: the uploads whose copies are complete go into the host's slot table (ExpertCache.publish
        sends it), unless a later plan took their slot again."""
        waiting = []
        for plan, copied in self.pending:
            if copied is not None and not copied.query():
                waiting.append((plan, copied))
                continue
            for slot, expert in plan:
                if self.resident[slot] == expert:
                    self.table_host[expert] = slot
        self.pending = waiting

    def _on_copy_stream(self, copies: Callable[[], object]) -> torch.cuda.Event | None:
        """Run `copies` on the layer's copy stream, after every kernel enqueued so far (the last steps' kernels read
        the slots they overwrite) -> the copy stream's event after them, for the kernels that read the slots next;
        None without a copy stream (a CPU standing in for the GPU: the copies ran in order)."""
        stream = self.copy_stream
        if stream is None:
            copies()
            return None
        stream.wait_stream(torch.cuda.current_stream(self.banks[0].data.device))
        with torch.cuda.stream(stream):
            copies()
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _upload(self, slot: int, expert: int) -> None:
        """Copy `expert` into slot `slot` from the host."""
        old = self.resident[slot]
        if old >= 0:
            self.slot_of[old] = -1
            if self.table_host is not None:
                self.table_host[old] = -2 - old  # streamed from the host until the next step reads the table
        for bank, t in zip(self.banks, self.host_tensors):
            bank.data[slot].copy_(t[expert], non_blocking=True)
        self.resident[slot], self.slot_of[expert] = expert, slot


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
    n_blocks = int(g.get(f"{g.arch}.block_count", n_layer))  # profile bake writes every block, NextN ones too
    if table.size % n_blocks:
        raise MoeprepError(f"{g.path}: {EXPERT_USAGE_KEY} holds {table.size} counts, not a multiple of {n_blocks} "
                           "blocks")
    return table.reshape(n_blocks, -1)[:n_layer]



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
    anatomy = describe_model(g)
    placement = place(anatomy, budgets, usage=config.usage)  # refuses a dense model: it has no experts
    if config.pin is None:
        config = replace(config, pin=should_pin(anatomy.roles[TensorRole.EXPERT.value].n_bytes, device))
    if config.slots_per_layer is not None:
        placement = fixed_slots(placement, config.slots_per_layer, anatomy.geometry.expert_bytes)
    return ExpertCache(placement, placement.n_expert, top_k, tuple(devices), config)


def fixed_slots(placement: Placement, per_layer: int, expert_bytes) -> Placement:
    """The placement with `per_layer` slots in every MoE layer (at most its experts), on the same GPUs; refused
    when a GPU's budget, after its non-expert share and the reserve, cannot hold them."""
    slots = tuple(min(per_layer, placement.n_expert) if s else 0 for s in placement.slots)
    cache = [0] * len(placement.budgets)
    for layer, n in enumerate(slots):
        if n:
            cache[placement.device[layer]] += n * expert_bytes[layer]
    for gpu, (budget, used, before, wanted) in enumerate(zip(placement.budgets, placement.used,
                                                             placement.cache_bytes, cache)):
        room = budget - (used - before)
        if wanted > room:
            raise MoeprepError(f"--cache-slots {per_layer}: gpu {gpu}'s slots take {format_size(wanted)}, but its "
                               f"budget of {format_size(budget)} leaves {format_size(room)} for slots; give fewer "
                               "slots, a larger --vram-budget, or --cache-slots auto")
    used = tuple(u - b + c for u, b, c in zip(placement.used, placement.cache_bytes, cache))
    return replace(placement, slots=slots, cache_bytes=tuple(cache), used=used)


def describe_cache(cache: ExpertCache) -> str:
    """What moerun prints at start: slots per layer and the share of all experts they hold."""
    p = cache.placement
    warm = "warmed from the profile's counts" if cache.config.usage is not None else "starting empty"
    misses = ("decode steps read their misses from page-locked RAM (streamed)" if cache.streamed
              else "the CPU computes the misses")
    host = "page-locked copies" if cache.config.pin else "the memory map"
    return (f"{p.describe()}\n  policy {cache.config.policy}, {warm}; budget "
            f"{', '.join(format_size(b) for b in p.budgets)}; experts uploaded from {host}; {misses}")
