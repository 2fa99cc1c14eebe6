"""load_model: a GGUF file -> a runnable Model (weights, tokenizer, KV cache, hooks); the arch is a table lookup."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE
from moeprep.gguf.reader import GGUFModel, open_gguf
from moerun.cache.config import CacheConfig
from moerun.cache.controller import ExpertCache, open_cache
from moerun.config import ModelArgs
from moerun.devices import DeviceMap, DeviceSpec, on_device, resolve_devices, split_by_bytes
from moerun.graphs import Chunk, DecodeGraphs, PromptGraphs, graph_blockers, prompt_graph_blockers
from moerun.hooks import ActivationEvent, HookHandle, Hooks, RoutingEvent
from moerun.kernels import tuning
from moerun.models import arch_module
from moerun.models.base import BuildContext, Transformer
from moerun.options import RuntimeOptions, process_options
from moerun.step import Step, group_rows
from moerun.tokenizer import Tokenizer
from moerun.weights import Weights

# KV cache length when the caller gives none: the trained context, capped to keep the cache small.
DEFAULT_MAX_CTX = 4096


class Model:
    """A loaded model. `forward` runs a chunk of one sequence's tokens through the KV cache, `forward_batch` tokens
    of several sequences at once; both return next-token logits. `device` is where tokens go (the first block's
    device); on several devices the logits come from the last block's (`net.layout`)."""

    def __init__(
        self,
        g: GGUFModel,
        args: ModelArgs,
        net: Transformer,
        tokenizer: Tokenizer,
        hooks: Hooks,
        n_ctx: int,
        device: torch.device,
        n_seq: int = 1,
        expert_cache: ExpertCache | None = None,
        decoded_bytes: int = 0,
        options: RuntimeOptions | None = None,
    ) -> None:
        self.gguf, self.args, self.net, self.tokenizer = g, args, net, tokenizer
        self.options = options or process_options()  # the switches it was built with (options.py)
        self.hooks, self.n_ctx, self.device, self.n_seq = hooks, n_ctx, device, n_seq
        self.expert_cache = expert_cache
        self.decoded_bytes = decoded_bytes  # VRAM of the dense weights' bfloat16 copies (load_model's dense_bf16)
        self.decode_graphs = DecodeGraphs(self) if device.type == "cuda" else None
        self.prompt_graphs: PromptGraphs | None = None  # made by capture_prompt_steps (a server's choice)
        # a layer whose state folds in every token it ran (a recurrent state, a ring of the last keys): a sequence
        # then goes on only from where it stopped, or anew from position 0, never from an earlier position
        self.keeps_history = any(getattr(m, "keeps_history", False) for m in net.modules())

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, seq: int = 0, last_only: bool = False) -> torch.Tensor:
        """tokens (T,) int64 at positions start_pos.. of sequence `seq` -> logits (T, V) float32, or (1, V) for the
        last token with `last_only` (a prompt to generate from); the sequence's slots from start_pos on are
        overwritten, so start_pos 0 starts it anew and a shared prefix can be kept (where `keeps_history`, only
        where the sequence stopped)."""
        T = tokens.shape[0]
        self._check_fits(start_pos + T, seq)
        chunk = [(tokens.tolist(), start_pos, seq)] if last_only and self.prompt_graphs is not None else []
        if chunk and self._prompt_graphs_fit(chunk):
            with on_device(self.device):
                return self.prompt_graphs(chunk)
        positions = torch.arange(start_pos, start_pos + T, device=self.device)
        outputs = torch.tensor([T - 1], device=self.device) if last_only else None
        return self.net(tokens.to(self.device), Step(positions, n_slots=start_pos + T, seq=seq), outputs)

    @torch.inference_mode()
    def forward_batch(
        self, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor, outputs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (T,) of several sequences in one pass: token t sits at positions[t] of sequence seqs[t] and
        attends to that sequence's slots up to its own position -> logits (T, V) float32, or (R, V) for the rows
        `outputs` (R,) only (the last token of each sequence in the batch, say). A sequence's consecutive tokens (a
        prompt chunk riding with other sequences' decode tokens) attend as a step of their own (Step.parts)."""
        positions, seqs = positions.long(), seqs.long()
        self._check_fits(int(positions.max()) + 1, int(seqs.max()))
        if int(seqs.min()) < 0:
            raise MoeprepError(f"sequence {int(seqs.min())} does not exist; the model holds {self.n_seq}")
        step = Step(
            positions.to(self.device),
            n_slots=int(positions.max()) + 1,
            seqs=seqs.to(self.device),
            groups=group_rows(positions.tolist(), seqs.tolist()),
        )
        return self.net(tokens.to(self.device), step, None if outputs is None else outputs.to(self.device))

    def prefill_chunks(self, chunks: list[Chunk]) -> torch.Tensor:
        """Prompt chunks of distinct sequences, each (tokens, start position, sequence) -> the logits (n, V) of each
        chunk's last token: runs of consecutive chunks that fit one captured prompt step together (graphs.PromptGraphs,
        after capture_prompt_steps), the others one eager forward each."""
        for tokens, start, seq in chunks:
            self._check_fits(start + len(tokens), seq)
        rows, i = [], 0
        while i < len(chunks):
            j = i + 1
            if self._prompt_graphs_fit(chunks[i:j]):
                while j < len(chunks) and self.prompt_graphs.fits(chunks[i : j + 1]):
                    j += 1
                with on_device(self.device):
                    rows.append(self.prompt_graphs(chunks[i:j]))
            else:
                tokens, start, seq = chunks[i]
                rows.append(self.forward(torch.tensor(tokens), start, seq, last_only=True))
            i = j
        return torch.cat(rows)

    def _prompt_graphs_fit(self, chunks: list[Chunk]) -> bool:
        return self.prompt_graphs is not None and self.prompt_graphs.fits(chunks) and not graph_blockers(self)

    def decode(self, token: int, pos: int, seq: int = 0) -> torch.Tensor:
        """One token at position `pos` of sequence `seq` -> the logits (V,) for the next (see decode_batch)."""
        return self.decode_batch([token], [pos], [seq])[0]

    def decode_batch(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """One token of each of several distinct sequences, token i at positions[i] of sequence seqs[i] -> the logits
        (B, V) for their next tokens: a CUDA graph replay where the step can be captured (see graphs.py), else an
        eager forward."""
        if len(set(seqs)) != len(seqs):
            raise MoeprepError(f"a decode batch takes one token per sequence, got sequences {seqs}")
        for pos, seq in zip(positions, seqs):
            self._check_fits(pos + 1, seq)
        if self.decode_graphs is not None and not graph_blockers(self):
            with on_device(self.device):  # captured on the model's GPU, whichever is current (cuda:1 alone, say)
                return self.decode_graphs(tokens, positions, seqs)
        if len(tokens) == 1:
            return self.forward(torch.tensor(tokens, dtype=torch.long), positions[0], seqs[0])
        return self.forward_batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(seqs))

    def capture_decode_steps(self) -> int:
        """Capture now the decode steps a server meets first: one token of each sequence alone, and batches of 2 to
        n_seq sequences, at the first KV bucket, so that no request waits for a capture (one takes a warm-up step
        and the capture, ~0.1-1 s on large models). Writes the KV slot of position 0 of every sequence, which a
        prompt overwrites; the expert cache's policy does not see these steps (ExpertCache.pause). -> graphs
        captured (0 where graphs cannot run)."""
        if self.decode_graphs is None or graph_blockers(self):
            return 0
        before = len(self.decode_graphs.graphs)
        with self._cache_paused():
            for seq in range(self.n_seq):
                self.decode_batch([0], [0], [seq])
            for n in range(2, self.n_seq + 1):
                self.decode_batch([0] * n, [0] * n, list(range(n)))
        return len(self.decode_graphs.graphs) - before

    def capture_prompt_steps(self, max_tokens: int) -> int:
        """From now on run prompt chunks of 2 to max_tokens tokens (`forward` with last_only, `prefill_chunks`) as
        CUDA graphs, padded to buckets of tokens and of chunks (graphs.PromptGraphs), and capture now those of at
        most max_tokens rows at the first KV bucket; others are captured the first time they come. Writes KV slots
        that prompts overwrite. -> graphs captured (0 where prompt graphs cannot run)."""
        if self.device.type != "cuda" or prompt_graph_blockers(self):
            return 0
        graphs = self.prompt_graphs = PromptGraphs(self, max_tokens, self.decode_graphs.pool)
        kv_bucket = graphs.kv_buckets[0]
        with on_device(self.device):
            for B in graphs.block_buckets:
                for tb in graphs.token_buckets:
                    if tb <= kv_bucket and B * tb <= max(max_tokens, graphs.SMALLEST):
                        graphs.graphs[B, tb, kv_bucket] = graphs.capture(B, tb, kv_bucket)
        return len(graphs.graphs)

    def warm_up(self) -> float:
        """Run each kind of step once so that no request waits for a kernel's compilation: a decode step (on a GPU
        also its graph's capture at the first KV bucket), and on a GPU a prompt on each route its products take
        (tuning.py: the matrix-vector kernel and the dense 8-bit GEMM, the experts' grouped GEMM, their 8-bit GEMM)
        and a step mixing a prompt chunk with another sequence's token. Triton compiles a kernel on its first use
        (1-3 s each on the H200 machine), numba the CPU kernels on the first run after an install (about 10 s with
        ggml's row dots, 90 without; its kernels take any number of tokens); both then load them from their disk
        caches. Writes KV slots that later prompts overwrite; the expert cache's policy does not see these steps.
        -> the seconds it took."""
        start = time.perf_counter()
        with self._cache_paused():
            self.decode(0, 0)
            n = min(2 * tuning.GEMV_MAX_TOKENS, self.n_ctx - 1)
            if self.device.type == "cuda" and n > 1:
                # the experts' routes: the matrix-vector kernel, the GEMM past it for one bank, then for gate and
                # up too (on the 8-bit GEMM's few-token tiles where it is on), the 8-bit GEMM's other tiles
                routes = {
                    n,
                    tuning.MOE_GEMV_MAX_TOKENS + 1,
                    tuning.MOE_GLU_GEMV_MAX_TOKENS + 1,
                    tuning.GEMM_I8_MIN_TOKENS if self.options.gemm_int8 else n,
                    tuning.GEMM_I8_FEW_TOKENS + 1 if self.options.gemm_int8 else n,
                }
                for length in sorted(length for length in routes if length < self.n_ctx):
                    self.forward(torch.zeros(length, dtype=torch.long), 0, 0, last_only=True)
                if self.n_seq > 1:
                    self.forward_batch(
                        torch.zeros(n + 1, dtype=torch.long),
                        torch.tensor([*range(n), 0]),
                        torch.tensor([0] * n + [1]),
                        torch.tensor([n]),
                    )
        self.synchronize()
        return time.perf_counter() - start

    @property
    def gpus(self) -> list[torch.device]:
        return [d for d in self.net.layout.devices if d.type == "cuda"]

    def synchronize(self) -> None:
        """Wait for the work queued on the model's GPUs (for timing; nothing to wait for on the CPU)."""
        for device in self.gpus:
            torch.cuda.synchronize(device)

    def _cache_paused(self):
        return self.expert_cache.pause() if self.expert_cache is not None else contextlib.nullcontext()

    def _check_fits(self, n_positions: int, seq: int) -> None:
        if n_positions > self.n_ctx:
            raise MoeprepError(
                f"{n_positions} positions do not fit the context of {self.n_ctx}; load with a larger n_ctx"
            )
        if not 0 <= seq < self.n_seq:
            raise MoeprepError(
                f"sequence {seq} does not exist; the model holds {self.n_seq} (load with a larger n_seq)"
            )

    def add_routing_hook(self, fn: Callable[[RoutingEvent], None]) -> HookHandle:
        return self.hooks.add_routing(fn)

    def add_activation_hook(self, fn: Callable[[ActivationEvent], None]) -> HookHandle:
        return self.hooks.add_activation(fn)


def load_model(
    path: str | Path | GGUFModel,
    device: DeviceSpec = "cpu",
    dtype: torch.dtype | None = None,
    n_ctx: int | None = None,
    n_seq: int = 1,
    cache: CacheConfig | None = None,
    dense_bf16: bool = True,
    options: RuntimeOptions | None = None,
) -> Model:
    """Open a GGUF MoE model (file or first shard) with a KV cache of n_seq sequences of n_ctx positions each.
    dtype defaults to float32 on CPU and bfloat16 on CUDA. With `cache`, routed experts stay in host RAM and run
    through the expert cache (cache/); otherwise they all go to the device, and with `dense_bf16` the
    quantized dense weights (attention, dense and shared FFNs, the output head) also keep a bfloat16 copy there for
    products of several tokens, if all the copies fit the free VRAM with DEFAULT_RESERVE to spare
    (layers/gguf_gpu.keep_decoded_copies; without the cache no expert slot wants that memory). `options`: the
    runtime's switches (options.py; default: this process's environment).

    device: "cpu", "cuda", "cuda:1", or several ("cuda:0,cuda:1" or a list): the blocks are split over them
    (devices.py), by the cache's placement or else by bytes. A cache with N budgets runs on N devices: "cuda" then
    means the first N GPUs (without budgets, every visible GPU with its free memory), "cpu" N CPU stand-ins."""
    g = path if isinstance(path, GGUFModel) else open_gguf(path)  # an opened model is not parsed again
    arch = arch_module(g.arch, g.path)  # an architecture moerun does not run is refused before any weight loads
    tokenizer = Tokenizer(g)  # and so is a tokenizer it does not know
    budgets = None if cache is None else cache.budgets
    devices = resolve_devices(device, len(budgets) if budgets else None, every_gpu=cache is not None)
    dtype = dtype or (torch.bfloat16 if devices[0].type == "cuda" else torch.float32)
    args = arch.read_args(g)
    n_ctx = n_ctx or min(args.n_ctx_train, DEFAULT_MAX_CTX)
    hooks, options = Hooks(), options or process_options()
    expert_cache = None if cache is None else open_cache(g, cache, args.n_layers, args.n_experts_used, devices, options)
    if expert_cache is None:
        layout = split_by_bytes(g, devices, args.n_layers)
    else:
        layout = DeviceMap(expert_cache.devices, expert_cache.placement.device[: args.n_layers])
    ctx = BuildContext(args, Weights(g, dtype, layout.first), hooks, n_ctx, n_seq, expert_cache, options)
    blocks = [arch.build_block(ctx.on(layout.device_of(layer)), layer) for layer in range(args.n_layers)]
    net = Transformer(ctx, blocks, layout)
    decoded = 0
    if dense_bf16 and expert_cache is None and layout.first.type == "cuda":
        from moerun.layers.gguf_gpu import keep_decoded_copies  # Triton: present where CUDA is

        decoded = keep_decoded_copies(net, DEFAULT_RESERVE)
    return Model(g, args, net.eval(), tokenizer, hooks, n_ctx, layout.first, n_seq, expert_cache, decoded, options)
