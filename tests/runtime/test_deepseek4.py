"""DeepSeek-V4 (`deepseek4`) against llama.cpp on the synthetic file (moeprep/synth/deepseek4.py): block 0 keeps raw
keys only and routes by token id, block 1 compresses by 4 with its lightning indexer, block 2 by 128, over 256
positions of the calibration text (past the 16-position sliding window, and past 128 so that both compressions
have entries to attend to).

llama.cpp's residual state after a block is 4 hyper-connection streams (its l_last-N, (T, 4, D)): each of our blocks,
fed llama.cpp's 4 streams, must give llama.cpp's next 4 streams (the last block's before the head's mix of them,
which the logits judge).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.step import Step
from tests.near_ties import MIN_JUDGED, judged, router_inputs, routing_margins, top1_margins
from tests.test_glm5_next import llama_run

N_POSITIONS = 256
LAYER_OUT = b"l_last-"


def tokens_of(model: moerun.Model, text: str, n: int = N_POSITIONS) -> list[int]:
    tokens = model.tokenizer.encode(text)[:n]
    assert len(tokens) == n
    return tokens


def streams_out(block: torch.nn.Module, x: torch.Tensor, step: Step) -> np.ndarray:
    """The block's 4 output streams (T, 4, D), the last block's too (not the head's mix of them)."""
    last, block.last = block.last, False
    try:
        return block(x, None, step)[0].numpy()
    finally:
        block.last = last


def block_errors(model: moerun.Model, tokens: list[int], streams: dict[int, np.ndarray]) -> list[np.ndarray]:
    """Each block fed llama.cpp's input streams: its relative error per position (T,) against llama.cpp's output
    streams."""
    net, T = model.net, len(tokens)
    step = Step(torch.arange(T), n_slots=T, tokens=torch.tensor(tokens))
    errors = []
    with torch.inference_mode():
        for layer, block in enumerate(net.blocks):
            x = net.embed(torch.tensor(tokens)) if layer == 0 else torch.from_numpy(streams[layer - 1])
            want = streams[layer]
            errors.append(np.abs(streams_out(block, x, step) - want).max((1, 2)) / np.abs(want).max())
    return errors


def run_both(model: moerun.Model, path: Path, tokens: list[int]):
    ref = llama_run(path, tokens, LAYER_OUT)
    experts: dict[int, np.ndarray] = {}
    handle = model.add_routing_hook(lambda ev: experts.__setitem__(ev.layer, ev.expert_ids.numpy()))
    with torch.inference_mode():
        ours = model.forward(torch.tensor(tokens)).numpy()
    handle.remove()
    return ref, ours, experts


@pytest.mark.parametrize("weights,options", [("F32", {}), ("F16", {}), ("F32", {"yarn": True})], ids=str)
def test_matches_llama_cpp(weights, options, synth_model, calibration_text):
    """At the positions no routing near-tie decides (tests/near_ties.py; at least 90% of them): logits within 1e-3
    relative, the same top-1 token where the two best are not as close, the same experts at every (token, layer)
    including the hash-routed layer, each block within 1e-4 (F32) / 2.5e-4 (F16) of llama.cpp given its input. With
    YaRN the compressed layers' RoPE is scaled (and its magnitude factor cancelled), the others' not."""
    path = synth_model("deepseek4", expert_type=weights, attn_type=weights, **options)
    model = moerun.load_model(path)
    tokens = tokens_of(model, calibration_text)
    with router_inputs(model) as inputs:
        ref, ours, experts = run_both(model, path, tokens)
    clear = judged(routing_margins(model, inputs))
    with router_inputs(model) as inputs:
        errors = block_errors(model, tokens, ref.streams)
    forced = judged(routing_margins(model, inputs))
    assert clear.mean() >= MIN_JUDGED and forced.mean() >= MIN_JUDGED, "too many routing near-ties"
    error = np.abs(ours - ref.logits)[clear].max() / np.abs(ref.logits).max()
    assert error <= 1e-3, f"logits differ by {error:.2e}"
    top1 = clear & judged(top1_margins(ours))
    assert (ours.argmax(-1) == ref.logits.argmax(-1))[top1].all()
    assert sorted(experts) == sorted(ref.topk) == [0, 1, 2]
    for layer, ids in ref.topk.items():
        same = [set(a) == set(b) for a, b in zip(experts[layer][clear], ids[clear])]
        assert all(same), f"layer {layer} chose other experts"
    bound = 1e-4 if weights == "F32" else 2.5e-4
    worst = [e[forced].max() for e in errors]
    assert max(worst) <= bound, [f"{e:.2e}" for e in worst]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_matches_llama_cpp(qtype, synth_model, calibration_text):
    """The small preset (rows of 256, so K-quants apply): llama.cpp rounds activations to 8 bits and we round the same
    way, but now and then a rounding lands the other way, and where that moves a routing near-tie the token takes
    other experts. At the positions no routing near-tie decides (tests/near_ties.py), each block given llama.cpp's
    input is within 1e-2 of llama.cpp's streams (within 1e-6 at the median position), and end to end the same
    experts and top-1 token are chosen (measured: Q8_0 99.6% / 98.0% of all positions, Q4_K 99.5% / 99.6%)."""
    path = synth_model("deepseek4", preset="small", expert_type=qtype, attn_type=qtype)
    model = moerun.load_model(path)
    tokens = tokens_of(model, calibration_text)
    with router_inputs(model) as inputs:
        ref, ours, experts = run_both(model, path, tokens)
    end_to_end = judged(routing_margins(model, inputs))
    with router_inputs(model) as inputs:
        errors = block_errors(model, tokens, ref.streams)
    forced = judged(routing_margins(model, inputs))
    assert end_to_end.mean() >= MIN_JUDGED and forced.mean() >= MIN_JUDGED, "too many routing near-ties"
    worst = max(e[forced].max() for e in errors)
    assert worst <= 1e-2, f"a block given llama.cpp's input differs by {worst:.2e}"
    assert max(np.median(e) for e in errors) <= 1e-6
    same = [
        set(a) == set(b) for layer, ids in ref.topk.items() for a, b in zip(experts[layer][end_to_end], ids[end_to_end])
    ]
    assert np.mean(same) >= 0.99, f"experts agree at only {np.mean(same):.2%} of (token, layer) pairs"
    clear = end_to_end & judged(top1_margins(ours))
    top1 = (ours.argmax(-1) == ref.logits.argmax(-1))[clear].mean()
    assert top1 >= 0.97, f"top-1 agrees at only {top1:.2%} of positions"


def test_hash_layer_routes_by_token_id(synth_model, calibration_text):
    """Block 0 takes the experts ffn_gate_tid2eid lists for each token, and the routing hooks (the expert cache's
    and the trace's) see them."""
    path = synth_model("deepseek4", expert_type="F32", attn_type="F32")
    model = moerun.load_model(path)
    tokens = tokens_of(model, calibration_text, 64)
    g = open_gguf(path)
    info = next(t for t in g.tensors if t.name == "blk.0.ffn_gate_tid2eid.weight")
    table = g.raw(info).view(np.int32).reshape(info.shape)
    seen: dict[int, np.ndarray] = {}
    handle = model.add_routing_hook(lambda ev: seen.__setitem__(ev.layer, ev.expert_ids.numpy()))
    with torch.inference_mode():
        model.forward(torch.tensor(tokens))
    handle.remove()
    np.testing.assert_array_equal(seen[0], table[tokens])
    assert not np.array_equal(np.sort(seen[1], 1), np.sort(table[tokens], 1))  # block 1 scores its experts


def with_top_k(src: Path, out: Path, top_k: int) -> Path:
    write_gguf(out, open_gguf(src), kv_set={"deepseek4.attention.indexer.top_k": KVValue(top_k, GGUFValueType.UINT32)})
    return out


def test_indexer_selection_matches_llama_cpp(synth_model, calibration_text, tmp_path):
    """With top_k 8, block 1 attends to its indexer's 8 best compressed entries once a query sees more than 8 (from
    position 35 on). Fed llama.cpp's 4 streams it gives llama.cpp's next streams at every position whose 8th and
    9th indexer scores are not tied: the synthetic scores are often exactly 0 (relu of every indexer head), and
    where a tie decides, each engine's top-k order picks. Attending to every entry instead would not match."""
    path = with_top_k(synth_model("deepseek4", expert_type="F32", attn_type="F32"), tmp_path / "k8.gguf", 8)
    model = moerun.load_model(path)
    tokens = tokens_of(model, calibration_text)
    ref = llama_run(path, tokens, LAYER_OUT)
    block, T = model.net.blocks[1], N_POSITIONS
    attn, step = block.attn.attn, Step(torch.arange(T), n_slots=T)
    x, want = torch.from_numpy(ref.streams[0]), ref.streams[1]
    with torch.inference_mode():
        with router_inputs(model) as inputs:
            errors = np.abs(streams_out(block, x, step) - want).max((1, 2)) / np.abs(want).max()
        untied = judged(routing_margins(model, inputs))  # no routing near-tie either
        h, _, _ = block.hc_attn.split(x)
        ranked = indexer_scores(attn, block.attn_norm(h), step.positions).sort(-1, descending=True).values
        attn.indexer.top_k = T  # every entry
        dense_errors = np.abs(streams_out(block, x, step) - want).max((1, 2)) / np.abs(want).max()
    sparse = np.arange(T) >= 35
    clear = untied & sparse & (ranked[:, 7] != ranked[:, 8]).numpy()
    assert clear.sum() >= 0.7 * sparse.sum()
    assert errors[untied & ~sparse].max() <= 1e-4 and errors[clear].max() <= 1e-4
    assert dense_errors[clear].max() > 10 * errors[clear].max()


def indexer_scores(attn: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(T, B) the indexer's scores of the compressed entries (-inf where not visible); its entries are cached."""
    import math

    from moerun.layers.kv_compression import rotate_tail

    ix = attn.indexer
    T, B = len(positions), N_POSITIONS // 4
    qr = attn.q_a_norm(attn.wq_a(x))
    q = rotate_tail(ix.rope, ix.q(qr).view(T, ix.n_heads, ix.head_size), positions)
    w = ix.proj(x).float() / math.sqrt(ix.n_heads * ix.head_size)
    scores = (torch.einsum("thd,bd->thb", q, ix.keys.cache[0, :B]).relu() * w[..., None]).sum(1)
    visible = torch.arange(B)[None, :] < (positions[:, None] + 1) // 4
    return scores.masked_fill(~visible, float("-inf"))


def test_cached_decode_equals_prefill(synth_model, calibration_text):
    """Chunks, then single tokens, carry the raw window, both compressors' states (across blocks of 4 and the block
    of 128 that completes at position 127) and the indexer's; position 0 starts over; two sequences side by side in
    one batch keep their own."""
    model = moerun.load_model(synth_model("deepseek4", expert_type="F32", attn_type="F32"), n_seq=2)
    tokens = torch.tensor(tokens_of(model, calibration_text, 140))
    with torch.inference_mode():
        full = model.forward(tokens)
        pieces = [model.forward(tokens[:61], 0), model.forward(tokens[61:126], 61)]
        pieces += [model.forward(tokens[i : i + 1], i) for i in range(126, 140)]
        tol = dict(rtol=1e-4, atol=1e-4 * full.abs().max().item())
        torch.testing.assert_close(torch.cat(pieces), full, **tol)
        torch.testing.assert_close(model.forward(tokens[:24], 0), full[:24], **tol)
        other = torch.tensor(tokens_of(model, calibration_text, 400)[260:400])
        other_full = model.forward(other, 0, seq=1)
        model.forward(tokens[:124], 0, seq=0)
        model.forward(other[:124], 0, seq=1)
        batched = [
            model.forward_batch(torch.stack([tokens[i], other[i]]), torch.tensor([i, i]), torch.tensor([0, 1]))
            for i in range(124, 132)
        ]
    torch.testing.assert_close(torch.stack([b[0] for b in batched]), full[124:132], **tol)
    torch.testing.assert_close(torch.stack([b[1] for b in batched]), other_full[124:132], **tol)
    # single tokens of one step, two of them of one sequence with another's between: in order
    with torch.inference_mode():
        mixed = model.forward_batch(
            torch.stack([tokens[132], other[132], tokens[133]]), torch.tensor([132, 132, 133]), torch.tensor([0, 1, 0])
        )
    torch.testing.assert_close(mixed[[0, 2]], full[132:134], **tol)
    torch.testing.assert_close(mixed[1], other_full[132], **tol)


def test_compressed_entries_count(synth_model, calibration_text):
    """Both compressions reach the test's positions: block 2 (ratio 128) without its compressed entry, and block 1
    (ratio 4) without its entries, no longer give llama.cpp's streams after the first entry completes."""
    path = synth_model("deepseek4", expert_type="F32", attn_type="F32")
    model = moerun.load_model(path)
    tokens = tokens_of(model, calibration_text)
    ref = llama_run(path, tokens, LAYER_OUT)
    step = Step(torch.arange(N_POSITIONS), n_slots=N_POSITIONS)
    for layer, first_entry in ((1, 3), (2, 127)):
        block = model.net.blocks[layer]
        x, want = torch.from_numpy(ref.streams[layer - 1]), ref.streams[layer]
        with torch.inference_mode():
            with router_inputs(model) as inputs:
                errors = np.abs(streams_out(block, x, step) - want).max((1, 2)) / np.abs(want).max()
            untied = judged(routing_margins(model, inputs))
            block.attn.attn.compressor.cache.zero_()
            block.attn.attn.compressor.update = lambda *args: None  # entries stay zero: keys of score 0, values 0
            blind = np.abs(streams_out(block, x, step) - want).max((1, 2)) / np.abs(want).max()
        assert untied.mean() >= MIN_JUDGED and errors[untied].max() <= 1e-4
        assert blind[:first_entry][untied[:first_entry]].max() <= 1e-4, f"block {layer}"
        assert blind[first_entry:].max() > 1e-2, f"block {layer}"


def test_inspect_shows_the_attention_pattern(synth_model):
    """`moeprep inspect` names each block's attention from attention.compress_ratios (the NextN block's included)."""
    from moeprep.gguf.anatomy import describe_model

    geometry = describe_model(open_gguf(synth_model("deepseek4"))).geometry
    assert geometry.attention == {
        "window": [0, 3],
        "window + 1/4 compressed, indexed": [1],
        "window + 1/128 compressed": [2],
    }
    assert geometry.nextn_layers == [3]


@pytest.mark.parametrize(
    "key",
    ["attention.compress_ratios", "attention.output_group_count", "hyper_connection.count", "attention.indexer.top_k"],
)
def test_without_its_keys_is_refused(key, synth_model, tmp_path):
    """Keys llama.cpp's deepseek4 loader requires: a file without one is refused in one line naming it."""
    from moeprep.errors import MoeprepError

    path = tmp_path / "missing.gguf"
    write_gguf(path, open_gguf(synth_model("deepseek4")), kv_remove=[f"deepseek4.{key}"])
    with pytest.raises(MoeprepError, match=f"deepseek4.{key}"):
        moerun.load_model(path)


def test_an_unknown_compression_ratio_is_refused(synth_model, tmp_path):
    """llama.cpp compresses by 4 or 128 only; another ratio is refused in one line."""
    from moeprep.errors import MoeprepError

    path = tmp_path / "ratio8.gguf"
    ratios = KVValue([0, 8, 128, 0], GGUFValueType.ARRAY, GGUFValueType.UINT32)
    write_gguf(path, open_gguf(synth_model("deepseek4")), kv_set={"deepseek4.attention.compress_ratios": ratios})
    with pytest.raises(MoeprepError, match="compress_ratios must give every block 0, 4 or 128"):
        moerun.load_model(path)
