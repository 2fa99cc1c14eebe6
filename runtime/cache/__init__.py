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
(44-50 GB/s on the H200 machine; kernels/staging.stage_second) and the matrix-vector kernel runs them in the same
launch as the cached ones. The step is then one CUDA graph; each layer records its routing on the device, and
after the step the host reads all layers' routing in one copy (`ExpertCache.step_done`) and counts hits, and while
the next step runs, the policy plans the uploads. The device tables change only between steps: an evicted expert
is marked "on the host" before the next step, an uploaded one becomes a slot once its copy is complete
(`CachedExperts.publish`). Measured against the CPU computing the misses (the design before, with the host
stopping at every layer): 60 GB model at 24 GiB, 46.5 -> 77.4 tok/s warm (docs/history/benchmarks-log.md).

The misses of a prompt (more tokens) and of any step where the experts are not page-locked (the memory map, whose
copies run at a seventh of the speed) go to the CPU instead: the slot of each expert lives on the host too
(`slot_of`), one small device-to-host copy per layer carries the router's choice, the hit/miss split is a numpy
lookup, the GPU gets its slot table with the launch and the CPU computes the misses meanwhile; a prompt's misses
chosen by several tokens are staged on the GPU instead (`_stage`). After the last cached layer the policy sees the
whole step's routing in one call.

Eager forwards (prompts, batches) and captured decode steps (graphs.py: the step's graphs are cut around each cached
layer's host work) run the same lookups, kernels and accounting. Layers, the KV cache and the routers stay on the
GPU (runtime/models); only the routed experts move.

Files: config.py (CacheConfig), controller.py (ExpertCache, open_cache), experts.py (CachedExperts), stats.py,
warm.py (warm start), host.py (the experts in host memory), placement.py (slots per layer and GPU), policy.py
(which misses earn an upload)."""
