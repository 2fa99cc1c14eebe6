"""CUDA graphs of the decode step: one token of each of B sequences, captured once per batch size and KV-length
bucket, then replayed.

Eager PyTorch spends about 0.47 ms of host time per layer enqueueing a decode step's small kernels, so a 46-layer
step cannot beat about 21 ms however fast the GPU is. A graph replays the whole step's kernels in one launch.
A captured step must have fixed shapes and no host syncs: the token and position live in static device buffers
(written before each replay), attention reads a fixed bucket of KV slots (the mask hides the ones past the position,
see step.Step), and the expert work runs on device-resident GGUF bytes. Buckets are powers of two, so a step
reads at most twice the slots it needs and a context of 4096 needs at most five captures per sequence.
A step of one sequence reads that sequence's slots where they lie (its graph is captured per sequence); a batch of
several sequences' tokens (`moerun serve --parallel`) reads each token's own sequence through static sequence ids,
so one graph per batch size serves any set of sequences.

With the expert cache streaming its misses (cache/) the step is one graph too, and the host reads the
step's routing after it (`Capture.after`). Where the misses are the CPU's instead, the host must act inside the
step: each cached layer's routing goes to the host, which looks the experts up, sends the slot table, and computes
the misses on the CPU while the GPU runs the hits. So the step is captured as a `Program`: graphs with host work
between them. A layer asks for the cut where its host work
goes (`step.capture.cut(work)`); a model without the cache is one graph. The graphs share one memory pool and
always replay in the order they were captured, so a tensor one graph writes is where the next one reads it.
A model over several GPUs (devices.py) is cut at each change of GPU too: a graph is captured on one device, and the
host work between two devices' graphs copies the hidden state and the step's positions to the next one.

What a graph cannot capture is listed by `graph_blockers`; the caller then runs the step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moerun.capture import Capture, Program
from moerun.layers import GGUFExperts
from moerun.step import Step

SMALLEST_BUCKET = 256


def kv_buckets(n_ctx: int) -> list[int]:
    """KV slot counts a decode step is captured for: 256, 512, ... and n_ctx itself as the last."""
    buckets, n = [], SMALLEST_BUCKET
    while n < n_ctx:
        buckets.append(n)
        n *= 2
    return [*buckets, n_ctx]


def graph_blockers(model) -> list[str]:
    """Why the decode step of `model` cannot run as a CUDA graph now (empty: it can)."""
    reasons = []
    if model.device.type != "cuda":
        reasons.append(f"the model runs on {model.device.type}, not CUDA")
    if model.hooks.routing or model.hooks.activation:
        reasons.append("hooks are registered (they run Python inside the step)")
    graphs = model.decode_graphs  # holds the tensors found at load: this runs before every decode step
    host = graphs.host_experts if graphs is not None else host_expert_tensors(model.net)
    reasons += [f"{name} is dequantized on the host" for name in host]
    return reasons


def prompt_graph_blockers(model) -> list[str]:
    """Why prompt chunks of `model` cannot run as CUDA graphs (empty: they can): what blocks decode graphs, and the
    expert cache (its layers act on the host between graphs, sized by a step's experts) and layers that index state
    of their own by the sequence's number (a captured prompt step gives the sequence as a device value)."""
    reasons = graph_blockers(model)
    if model.expert_cache is not None:
        reasons.append("the expert cache runs prompt steps eagerly")
    reasons += sorted(
        {
            f"{type(m).__name__} reads the sequence on the host"
            for m in model.net.modules()
            if getattr(m, "seq_on_host", False)
        }
    )
    return reasons


def host_expert_tensors(net: torch.nn.Module) -> list[str]:
    """Expert tensors whose type has no device dequantizer (their bytes go through the host every step)."""
    return [
        t.name for m in net.modules() if isinstance(m, GGUFExperts) for t in (m.gate, m.up, m.down) if not t.on_device
    ]


class DecodeGraphs:
    """Captured decode steps of `model`, sharing one memory pool: a step of one sequence keyed by (sequence, 1, KV
    bucket), a batch of B > 1 sequences by (-1, B, KV bucket).

    Calling it runs one token of each of B distinct sequences at their positions and returns the logits (B, V) for
    their next tokens. Graphs are captured lazily, the first time a key is needed; they read the KV cache and
    weights where they lie, so eager forward calls (prefill) between replays are fine. Layers with host work inside
    the step get `prepare_capture(B)` first (pinned buffers cannot be allocated during a capture).
    """

    def __init__(self, model) -> None:
        self.model = model
        self.host_experts = host_expert_tensors(model.net)  # fixed at load; a walk of every module costs ~1 ms
        self.buckets = kv_buckets(model.n_ctx)
        self.inputs: dict[int, torch.Tensor] = {}  # batch size -> (3, B) int64 on the device: tokens, positions, seqs
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], tuple[Program, torch.Tensor]] = {}

    @torch.inference_mode()
    def __call__(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        B = len(tokens)
        if B not in self.inputs:
            self.inputs[B] = torch.zeros(3, B, dtype=torch.long, device=self.model.device)
        self.inputs[B].copy_(torch.tensor([tokens, positions, seqs]))  # from pageable memory: read before it returns
        bucket = next(b for b in self.buckets if b > max(positions))
        key = (seqs[0] if B == 1 else -1, B, bucket)
        if key not in self.graphs:
            # the step ran once before its capture: its logits are this step's, and a replay would feed the tokens
            # a second time, which a recurrent state keeps (a graph is first met in the middle of a sequence)
            program, logits, ran = self._capture(*key)
            self.graphs[key] = program, logits
            return ran.clone()
        program, logits = self.graphs[key]
        program.replay()
        return logits.clone()  # the static output is overwritten by the next replay

    def _capture(self, seq: int, B: int, bucket: int) -> tuple[Program, torch.Tensor, torch.Tensor]:
        tokens, positions, seqs = self.inputs[B]

        def step(capture: Capture | None) -> torch.Tensor:
            if B == 1:
                return self.model.net(tokens, Step(positions, n_slots=bucket, seq=seq, capture=capture))
            return self.model.net(tokens, Step(positions, n_slots=bucket, seqs=seqs, capture=capture))

        for module in self.model.net.modules():
            if hasattr(module, "prepare_capture"):
                module.prepare_capture(B)
        return capture_program(self.model, step, self.pool)


def capture_program(
    model, step: Callable[[Capture | None], torch.Tensor], pool
) -> tuple[Program, torch.Tensor, torch.Tensor]:
    """Run `step` once uncaptured (lazy allocations, kernel selection and compiles happen outside the capture), then
    capture it on a side stream, the Capture handed to the step: -> the Program, its static output, and the output
    of the uncaptured run (the capture runs nothing: that run is the step's one run until the first replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ran = step(None)
    torch.cuda.current_stream().wait_stream(side)
    for device in set(model.net.layout.devices):
        torch.cuda.synchronize(device)
    with torch.cuda.stream(side), Capture(pool) as capture:
        out = step(capture)
    return capture.program, out, ran


Chunk = tuple[list[int], int, int]  # a prompt chunk: its tokens, its first position, its sequence


class PromptGraphs:
    """Captured prompt steps: up to n_seq prompt chunks of distinct sequences, each of 2 to `max_tokens` tokens, run
    together as B blocks of Tb rows (B the next power of two at or above the number of chunks, Tb the next bucket
    of 16, 32, ... max_tokens at or above the longest chunk); the graph of (B, Tb, KV bucket) returns the logits
    (B, V) of each block's last real token. Eager PyTorch spends ~85 ms of host time on a prompt chunk of the
    48-layer 30B shape, of any length up to a few hundred tokens (`moerun serve`'s prompts waited on it); and the
    routed experts of several chunks cost little more than those of one (a 64-token chunk already touches most of
    the 30B shape's 128 experts per layer), so chunks that arrive together run as one step.

    The sequences are a device value (Step.seq as a (B,) tensor), so one graph serves every set of sequences.
    Padding rows sit at the positions after their chunk's: they write KV slots that the sequence's next tokens
    overwrite before anything reads them, and no real token attends to them (they come later). Padding blocks repeat
    the first chunk exactly, writing the same values to the same slots. So chunks fit when each one's position plus
    Tb stays within the context and B x Tb within `max_rows`; `fits` says so, and the caller runs the others
    eagerly.
    """

    SMALLEST = 16  # tokens: the prompt GEMMs' size; fewer would take the decode kernels

    def __init__(self, model, max_tokens: int, pool) -> None:
        self.model, self.pool = model, pool
        self.token_buckets = [self.SMALLEST]
        while self.token_buckets[-1] < max_tokens:
            self.token_buckets.append(self.token_buckets[-1] * 2)
        self.block_buckets = [1]
        while self.block_buckets[-1] < model.n_seq:
            self.block_buckets.append(self.block_buckets[-1] * 2)
        self.max_rows = 2 * self.token_buckets[-1]  # a step of several chunks pads them to one length
        self.kv_buckets = kv_buckets(model.n_ctx)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (B, Tb) -> (2, B * Tb): tokens, positions
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}  # (B, Tb) -> (2, B): each block's sequence, last row
        self.graphs: dict[tuple[int, int, int], tuple[Program, torch.Tensor]] = {}

    def buckets(self, chunks: list[Chunk]) -> tuple[int, int, int] | None:
        """(B, Tb, KV bucket) of a step of these chunks, or None when they do not fit one."""
        longest = max(len(tokens) for tokens, _, _ in chunks)
        B = next((b for b in self.block_buckets if b >= len(chunks)), None)
        tb = next((b for b in self.token_buckets if b >= longest), None)
        if B is None or tb is None or B * tb > self.max_rows or min(len(t) for t, _, _ in chunks) < 2:
            return None
        end = max(start for _, start, _ in chunks) + tb
        if end > self.model.n_ctx or len({seq for _, _, seq in chunks}) < len(chunks):
            return None
        return B, tb, next(b for b in self.kv_buckets if b >= end)

    def fits(self, chunks: list[Chunk]) -> bool:
        return self.buckets(chunks) is not None

    @torch.inference_mode()
    def __call__(self, chunks: list[Chunk]) -> torch.Tensor:
        """-> the logits (len(chunks), V) of each chunk's last token."""
        B, tb, kvb = self.buckets(chunks)
        tokens, positions, seqs, last = [], [], [], []
        for i, (chunk, start, seq) in enumerate(chunks + chunks[:1] * (B - len(chunks))):
            tokens += chunk + [chunk[-1]] * (tb - len(chunk))
            positions += range(start, start + tb)
            seqs.append(seq)
            last.append(i * tb + len(chunk) - 1)
        self._buffers(B, tb)
        self.inputs[B, tb].copy_(torch.tensor([tokens, positions]))  # from pageable memory: read before it returns
        self.blocks[B, tb].copy_(torch.tensor([seqs, last]))
        if (B, tb, kvb) not in self.graphs:
            self.graphs[B, tb, kvb] = self.capture(B, tb, kvb)
        program, logits = self.graphs[B, tb, kvb]
        program.replay()
        return logits[: len(chunks)].clone()  # the static output is overwritten by the next replay

    def _buffers(self, B: int, tb: int) -> None:
        """The static inputs of (B, Tb) steps, made on first use: each block token ids 0.. at positions 0.. of
        sequences 0.. (a capture at start-up runs them), until a step writes its own."""
        if (B, tb) not in self.inputs:
            device, rows = self.model.device, torch.arange(tb).repeat(B)
            self.inputs[B, tb] = torch.stack([rows, rows]).to(device)  # identical blocks write identical KV
            seqs, last = torch.arange(B) % self.model.n_seq, torch.arange(B) * tb + tb - 1
            self.blocks[B, tb] = torch.stack([seqs, last]).to(device)

    def capture(self, B: int, tb: int, kvb: int) -> tuple[Program, torch.Tensor]:
        self._buffers(B, tb)
        tokens, positions = self.inputs[B, tb]
        seqs, last = self.blocks[B, tb]

        def step(capture: Capture | None) -> torch.Tensor:
            return self.model.net(tokens, Step(positions, n_slots=kvb, seq=seqs, capture=capture), outputs=last)

        # the replay after the capture writes the KV slots the uncaptured run wrote, with the same values (no model
        # with a recurrent state runs prompt graphs: prompt_graph_blockers)
        program, out, _ = capture_program(self.model, step, self.pool)
        return program, out
