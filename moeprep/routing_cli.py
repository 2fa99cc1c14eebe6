"""`moeprep routing`: routing traces from named regimes, from profiles, and what they mean for an expert cache.
Each command parses, calls one library function (moeprep/profile/regimes.py, routing_stats.py, tracefile.py) and
prints."""

from __future__ import annotations

import json
from pathlib import Path

import click

REGIME_NAMES = ["qwen3-30b", "fine-512", "skewed-256", "chat-glm", "trained"]  # the keys of regimes.REGIMES (tested)


@click.group()
def routing() -> None:
    """Routing traces for the expert cache: generate one from a named regime, extract one from a profile, and
    measure skew, reuse and every cache policy's hit rate on one (`moerun bench --routing` replays them)."""


@routing.command()
@click.option("--regime", "name", required=True, type=click.Choice(REGIME_NAMES), help="Which routing to generate.")
@click.option("--layers", type=click.IntRange(min=1), help="MoE layers (default: the regime's own shape).")
@click.option("--experts", type=click.IntRange(min=1), help="Experts per layer (default: the regime's own).")
@click.option("--top-k", type=click.IntRange(min=1), help="Experts per token (default: the regime's own).")
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=1), help="Tokens in all.")
@click.option(
    "--chunk",
    type=click.IntRange(min=1),
    help="Tokens per chunk, each a fresh sequence (default: the regime's, 1024 or 512).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Trace file to write (.npz)."
)
def generate(
    name: str,
    layers: int | None,
    experts: int | None,
    top_k: int | None,
    tokens: int,
    chunk: int | None,
    seed: int,
    output: Path,
) -> None:
    """Write a routing trace of a named regime at a model's shape (a replay needs the model's own)."""
    from moeprep.profile.regimes import Shape, regime
    from moeprep.profile.regimes import generate as make
    from moeprep.profile.tracefile import write_trace

    r = regime(name)
    shape = Shape(layers or r.shape.layers, experts or r.shape.experts, top_k or r.shape.top_k)
    t = make(name, shape, tokens, chunk or r.target_chunk, seed)
    write_trace(output, t)
    click.echo(f"wrote {output}: regime {name}, {t.n_tokens} tokens in {t.n_chunks} chunks, {t.shape_text()}")


@routing.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Trace file to write (.npz)."
)
def extract(profile: Path, output: Path) -> None:
    """Write the routing a `moeprep profile` recorded (every chunk, in order) as a trace file."""
    from moeprep.profile.format import read_profile
    from moeprep.profile.tracefile import trace_from_profile, write_trace

    t = trace_from_profile(read_profile(profile), str(profile))
    write_trace(output, t)
    click.echo(f"wrote {output}: {t.n_tokens} tokens in {t.n_chunks} chunks, {t.shape_text()}")


@routing.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.option("--per-layer", is_flag=True, help="Also print every layer's skew, reuse and LRU hit rates.")
@click.option(
    "--regime",
    "name",
    type=click.Choice(REGIME_NAMES),
    help="Check the trace against this regime's targets (default: the regime that generated it).",
)
def stats(trace: Path, as_json: bool, per_layer: bool, name: str | None) -> None:
    """Skew, reuse and the hit rates of LRU, LFU, ClassLRU, payback, cost-payback, Belady and the frequency oracle at
    10 / 25 / 38 / 50% of the experts cached, cold and after 64 tokens; a TRACE file or a .moeprof profile."""
    from tqdm import tqdm

    from moeprep.profile.regimes import REGIMES, Shape, check_targets
    from moeprep.profile.routing_stats import STAT_POLICIES, format_stats, routing_stats
    from moeprep.profile.tracefile import read_trace

    t = read_trace(trace)
    with tqdm(
        total=t.n_chunks * len(STAT_POLICIES),
        unit="chunk",
        desc="replay",
        dynamic_ncols=True,
        disable=None,
        leave=False,
    ) as bar:
        s = routing_stats(t, progress=lambda n: bar.update(n * len(STAT_POLICIES)))
    r = REGIMES.get(name or t.regime)
    checks = None
    if r is not None and (name or Shape(t.n_layers, t.n_expert, t.top_k) == r.shape):
        checks = check_targets(r, t)
    if as_json:
        out = s.to_dict() | {"regime": t.regime, "source": t.source}
        if checks is not None:
            out["targets"] = [{"target": c.target.describe(), "value": round(c.value, 4), "met": c.met} for c in checks]
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"{trace}: {t.source or 'routing trace'}")
    click.echo(format_stats(s, per_layer))
    if checks is not None:
        click.echo(
            f"\ntargets of regime {r.name} (stated at {r.shape.layers} layers, {r.shape.experts} experts, "
            f"top-{r.shape.top_k}):"
        )
        for c in checks:
            click.echo(f"  {'met' if c.met else 'MISSED'}: {c.target.describe()}: {c.value:.1%}")
    elif r is not None:
        click.echo(
            f"\n(regime {r.name}'s targets are stated at {r.shape.layers} layers, {r.shape.experts} experts, "
            f"top-{r.shape.top_k}; give --regime {r.name} to check them at this shape anyway)"
        )


@routing.command()
def regimes() -> None:
    """List the named regimes: their shape, targets and where the targets come from."""
    from moeprep.profile.regimes import REGIMES

    for r in REGIMES.values():
        click.echo(
            f"{r.name}: {r.about}; targets at {r.shape.layers} layers, {r.shape.experts} experts, top-{r.shape.top_k}:"
        )
        for x in r.targets:
            click.echo(f"  {x.describe()}")
        click.echo(f"  source: {r.source}")
