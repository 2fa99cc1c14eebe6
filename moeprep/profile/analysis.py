"""Reading a profile: the text tables `moeprep profile` and `profile show` print, and the PNG plot.

Letters: M MoE layers, E experts per layer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.profile.heldout import ABOUT, SIZES, HeldoutTable, cache_slots
from moeprep.profile.profile import Profile


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def effective_experts(shares: np.ndarray) -> np.ndarray:
    """[M] exp(entropy) of each layer's selection shares: E when use is uniform, 1 when one expert takes all."""
    logs = np.log(shares, out=np.zeros_like(shares), where=shares > 0)
    return np.exp(-(shares * logs).sum(axis=1))


def format_summary(p: Profile) -> str:
    m, c = p.model, p.counts
    lines = [
        f"model    {m.name} ({m.arch}): {m.n_layer} layers, {len(m.moe_layers)} MoE x {m.n_expert} experts, "
        f"{m.n_expert_used} per token; router {m.router_sha256[:12]}"
    ]
    for s in p.sources:
        what = " ".join(x for x in (s.dataset, s.config, s.split) if x)
        weight = f", weight {s.weight}" if s.weight != 1 else ""
        lines.append(
            f"text     {what}: {s.chunks} chunks x {s.ctx} tokens counted ({s.tokens} tokens), "
            f"{s.heldout_chunks} held out{weight}"
        )
    shares, coverage = c.shares(), c.coverage()
    eff = effective_experts(shares)
    hot_cols = [cache_slots(size, c.n_expert) for size in SIZES]
    head = (
        f"{'block':>5} {'tokens':>9} {'used':>9} {'top-1':>6} "
        + " ".join(f"{f'hot {k}':>7}" for k in hot_cols)
        + f" {'eff. experts':>12}"
    )
    lines += ["", "share of selections covered by the hottest k experts of each layer:", head]
    for row, block in enumerate(c.layers):
        used = int((c.selections[row] > 0).sum())
        lines.append(
            f"{block:>5} {c.tokens[row]:>9} {f'{used}/{c.n_expert}':>9} {_pct(shares[row].max())} "
            + " ".join(f"{_pct(coverage[row, k - 1]):>7}" for k in hot_cols)
            + f" {eff[row]:>12.1f}"
        )
    return "\n".join(lines)


def format_heldout(h: HeldoutTable | None, per_layer: bool = False) -> str:
    if h is None:
        return "held-out: none (profile with --holdout above 0 to judge the profile on text it did not count)"
    lines = [
        f"held-out: {h.chunks} chunks, {h.tokens} tokens never counted; expert-cache hit rate, "
        f"{' / '.join(h.windows)} tokens of a chunk:",
        f"{'cache':>12} " + " ".join(f"{p:>15}" for p in h.policies),
    ]
    overall = h.overall()
    for si, (size, slots) in enumerate(zip(h.sizes, h.slots)):
        cells = [" /".join(_pct(overall[pi, si, wi]) for wi in range(len(h.windows))) for pi in range(len(h.policies))]
        lines.append(f"{f'{size:.0%} ({slots})':>12} " + " ".join(f"{cell:>15}" for cell in cells))
    lines += [f"  {p}: {ABOUT.get(p, '')}" for p in h.policies]
    if per_layer:
        rates = h.layer_rates()
        for wi, window in enumerate(h.windows):
            lines += [
                "",
                f"per layer, {window} tokens ({', '.join(h.policies)} for each size):",
                f"{'block':>5} " + " | ".join(f"{f'{size:.0%}':^{8 * len(h.policies) - 1}}" for size in h.sizes),
            ]
            for mi, block in enumerate(h.layers):
                lines.append(
                    f"{block:>5} "
                    + " | ".join(
                        " ".join(f"{_pct(rates[pi, si, wi, mi]):>7}" for pi in range(len(h.policies)))
                        for si in range(len(h.sizes))
                    )
                )
    return "\n".join(lines)


def plot_profile(p: Profile, out: str | Path) -> None:
    """PNG: a layers x experts heatmap of selection shares, and per layer the share the hottest k experts cover."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MoeprepError(f"{out}: plotting needs matplotlib; pip install matplotlib") from e
    c = p.counts
    shares, coverage = c.shares(), c.coverage()
    fig, (heat, cum) = plt.subplots(
        1, 2, figsize=(14, max(4.0, 0.18 * len(c.layers) + 2)), gridspec_kw={"width_ratios": [3, 2]}
    )
    image = heat.imshow(shares, aspect="auto", interpolation="nearest", cmap="magma")
    heat.set_yticks(range(len(c.layers)), [str(b) for b in c.layers], fontsize=7)
    heat.set_xlabel("expert")
    heat.set_ylabel("block")
    heat.set_title("share of each layer's selections")
    fig.colorbar(image, ax=heat, fraction=0.04)
    ks = np.arange(1, c.n_expert + 1)
    colors = plt.cm.viridis(np.linspace(0, 1, len(c.layers)))
    for row, block in enumerate(c.layers):
        cum.plot(ks, coverage[row], color=colors[row], lw=1, label=f"block {block}" if len(c.layers) <= 12 else None)
    cum.plot(ks, ks / c.n_expert, "k--", lw=1, label="uniform")
    cum.set_xlabel("hottest k experts")
    cum.set_ylabel("share of selections covered")
    cum.set_title("coverage per layer (dark: first blocks)")
    cum.set_ylim(0, 1.01)
    cum.grid(alpha=0.3)
    cum.legend(fontsize=7)
    fig.suptitle(f"{p.model.name}: {int(c.tokens.max(initial=0))} tokens counted")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise MoeprepError(f"{out}: cannot write the plot ({e.strerror}); check the path") from e
    finally:
        plt.close(fig)
