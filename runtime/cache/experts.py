"""`CachedExperts`: one layer's routed experts through the cache, an ExpertCompute (see the package docstring for
the three ways a step runs: streamed, eager, captured)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from moerun.cache.config import STAGE_MIN_TOKENS
from moerun.cache.controller import ExpertCache
from moerun.cache.host import read_only_tensor
from moerun.cache.stats import timed
from moerun.hooks import Hooks
from moerun.kernels.cpu.formats import ExpertBytes
from moerun.kernels.cpu.moe_rows import moe_rows
from moerun.kernels.tuning import GEMV_MAX_TOKENS
from moerun.layers.ffn import Activation
from moerun.layers.ops import Kernels
from moerun.step import Step

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel


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
        return cls(
            pinned(T, 2 * K),
            pinned(T, D),
            pinned(T, K, dtype=torch.int32),
            torch.zeros(T, K, dtype=torch.int32, device=device),
            pinned(T, D),
            torch.zeros(T, D, device=device),
        )


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

    def __init__(
        self,
        layer: int,
        host: tuple[ExpertBytes, ExpertBytes, ExpertBytes],
        n_slots: int,
        activation: Activation,
        kernels: Kernels,
        cache: ExpertCache,
        hooks: Hooks,
    ) -> None:
        super().__init__()
        from moerun.kernels.qweight import QWeight

        self.layer, self.host, self.cache, self.hooks = layer, host, cache, hooks
        self.activation, self.act = activation, activation.on(kernels)
        device = cache.device_of(layer)
        self.copy_stream = cache.copy_streams.get(device)  # uploads into this layer's slots
        self.host_tensors = tuple(read_only_tensor(t.data) for t in host)
        made: dict[int, QWeight] = {}  # one bank for a host tensor given twice (ungated experts' up as their gate)
        for t, h in zip(host, self.host_tensors):
            if id(t) not in made:
                made[id(t)] = QWeight(
                    torch.empty(n_slots, t.rows, t.data.shape[-1], dtype=torch.uint8, device=device),
                    t.qtype,
                    t.rows,
                    t.cols,
                    second=h if cache.streamed else None,
                )
        self.banks = tuple(made[id(t)] for t in host)
        self.uploads = tuple((made.pop(id(t)), h) for t, h in zip(host, self.host_tensors) if id(t) in made)
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
    def for_layer(
        cls, g: GGUFModel, layer: int, cache: ExpertCache, hooks: Hooks, activation: Activation, kernels: Kernels
    ) -> CachedExperts:
        """The layer's experts with the slots the placement gave it, warmed with the hottest known experts."""
        experts = cls(
            layer, cache.host_experts(g, layer), cache.placement.slots[layer], activation, kernels, cache, hooks
        )
        experts.fill(cache.warm_order(layer))
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

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        step: Step | None = None,
        i8: QAct | None = None,
    ) -> torch.Tensor:
        """`i8`: x's int8 rounding where its norm made one, for the GPU's products of x (_hits)."""
        if self.hooks.activation:
            raise MoeprepError("activation hooks (imatrix collection) need the model loaded without the expert cache")
        capture = None if step is None else step.capture
        if self.streams(ids.shape[0]):
            out = self._streamed(x, ids, weights, capture, i8)
            self.cache.record(self, ids, step)
            return out
        if capture is not None:
            return self._captured(capture, x, ids, weights, i8)
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
        out = self._hits(x, torch.from_numpy(self.slot_of[ids_h]).to(x.device), weights, ids, i8=i8)
        if on_cpu.any() and x.shape[0] >= STAGE_MIN_TOKENS and x.device.type in self.cache.options.staging_devices:
            staged = self._stage(x, ids_h, on_cpu, weights, ids, i8)
            if staged is not None:
                on_cpu, staged_out = staged
                out = out + staged_out
        if on_cpu.any():
            if x_ready is not None:
                x_ready.synchronize()
            out = self._add_misses(out, x_host.numpy(), ids_h, weights_h, on_cpu)
        self._account(ids_h, missed)  # the cache's hits and misses, whoever computed the misses
        return out

    def _streamed(self, x, ids, weights, capture, i8) -> torch.Tensor:
        """A decode-sized step: every expert in one launch, the misses from the host copies. On a GPU the misses
        are first copied to the staging bank by a copy kernel (twice the bus speed of the matrix-vector kernel's
        own loads; stage_second), where it holds all of the step's pairs (else they are read in place)."""
        slots, banks, second = self.table[ids], self.banks, None
        if x.device.type in self.cache.options.staging_devices:
            stage = self.cache.staging(self)
            if stage[0].data.shape[0] >= slots.numel():
                from moerun.kernels.staging import stage_second

                banks, slots = stage_second(slots, self.banks, tuple(b.data for b in stage))
                second = ids.reshape(-1)  # staging matrix p holds pair p's expert
        return self._hits(x, slots, weights, ids, banks, second=second, captured=capture is not None, i8=i8)

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

    def _stage(self, x, ids_h, missed, weights, ids, i8) -> tuple[np.ndarray, torch.Tensor] | None:
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
            staged = self._hits(x, torch.from_numpy(slots).to(x.device), weights, ids, banks, in_bank, i8=i8)
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

    def _hits(
        self, x, slots, weights, ids, banks=None, experts=None, second=None, captured=False, i8=None
    ) -> torch.Tensor:
        """sum_k weights * expert(x) over the (t, k) whose slot in `banks` (default: the cache's) is not -1;
        experts[s]: the expert in slot s (for its biases; default: the policy's slots), and
        second[j] the expert of the second bank's matrix j (slot -2 - j; default: expert j, the host copies);
        `captured`: inside a captured step (no timing events); i8: x's int8 rounding, if made (the GPU's products
        take it)."""
        if x.device.type == "cpu":
            return self._hits_on_cpu(
                x,
                slots,
                weights,
                banks or self.banks,
                self.resident if experts is None else experts,
                np.arange(len(self.slot_of)) if second is None else second.numpy(),
            )
        from moerun.layers.gguf_gpu import bank_moe  # Triton: present where CUDA is

        timing = self.cache.timing and not captured
        if timing:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        out = bank_moe(
            x, slots, weights, banks or self.banks, self.activation, self.act, self.biases, ids, i8, self.cache.routes
        )
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
        slot_bytes = tuple(
            ExpertBytes(
                b.data.numpy(), b.qtype, b.rows, b.cols, None if t.bias is None else t.bias[np.maximum(experts, 0)]
            )
            for b, t in zip(banks, self.host)
        )
        out = np.zeros(tuple(x.shape), np.float32)
        moe_rows(
            x.float().numpy(),
            slots.numpy(),
            weights.float().numpy(),
            *slot_bytes,
            self.activation.name,
            out,
            self.cache.config.cpu_threads,
            limit=self.activation.limit,
            up_limit=self.activation.up_limit,
            ggml=self.cache.ggml,
        )
        return torch.from_numpy(out)

    def _misses(self, x: np.ndarray, ids_h, weights_h, missed, out: np.ndarray) -> None:
        with timed(self.cache.stats, "CPU experts"):
            moe_rows(
                x,
                np.where(missed, ids_h, -1),
                weights_h,
                *self.host,
                self.activation.name,
                out,
                self.cache.config.cpu_threads,
                limit=self.activation.limit,
                up_limit=self.activation.up_limit,
                ggml=self.cache.ggml,
            )

    # ---- inside a captured decode step (graphs.py): the graph's side, then the host's work at each cut

    def _captured(self, capture, x, ids, weights, i8) -> torch.Tensor:
        buf = self.step_buffers[ids.shape[0]]  # made by prepare_capture
        buf.routing.copy_(self._routing(ids, weights), non_blocking=True)
        buf.x.copy_(x.float(), non_blocking=True)
        capture.cut(lambda: self._route_step(buf))
        out = self._hits(x, buf.slots, weights, ids, captured=True, i8=i8)
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
        for bank, t in self.uploads:
            bank.data[slot].copy_(t[expert], non_blocking=True)
        self.resident[slot], self.slot_of[expert] = expert, slot
