"""Recipes: the shipped ones load and plan on their architecture; a bad file is one line naming the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.quant.plan import parse_rule, parse_type, plan_requant
from moeprep.recipe import SECTIONS, load_recipe, parse_recipe, recipe_text
from moeprep.synth import SYNTH_ARCHS, write_synth_model

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))
# the families recipes/ covers (Mixtral is `llama` in GGUF), GLM-5.3-Flash and the newer MoE releases
FAMILIES = {
    "qwen3moe",
    "deepseek2",
    "glm4moe",
    "gpt-oss",
    "llama",
    "glm5-next",
    "mimo2",
    "qwen35moe",
    "qwen3next",
    "minimax-m2",
    "llama4",
    "deepseek32",
    "dots1",
    "ernie4_5-moe",
    "hunyuan-moe",
    "bailingmoe2",
    "glm-dsa",
    "gemma4",
    "afmoe",
    "smallthinker",
    "lfm2moe",
    "step35",
    "laguna",
    "kimi-k3",
    "deepseek4",
}
GOOD = """
name = "Test"
arch = "qwen3moe"
[quantize]
attn = "Q5_K"
types = ["token_embd=Q8_0"]
[calibration]
chunks = 8
"""


def test_one_recipe_per_family() -> None:
    recipes = [load_recipe(p) for p in RECIPES]
    assert {r.arch for r in recipes} == FAMILIES
    assert len({r.name for r in recipes}) == len(recipes)
    for r in recipes:
        assert r.calibration.chunks * r.calibration.ctx >= 32768, r.name  # real calibration, not a test setting
        assert r.publish.base_model is None, "a family recipe covers several models: base_model comes per model"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_plans_on_its_architecture(path: Path, tmp_path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.arch in SYNTH_ARCHS
    # deepseek2: the layout with attn_k_b, whose rows are qk_nope_head_dim = 128 wide as in V3
    options = {"mla_split": True, "qk_nope_dim": 128} if recipe.arch in ("deepseek2", "deepseek32") else {}
    model = open_gguf(write_synth_model(tmp_path / "m.gguf", recipe.arch, **options))
    plan = plan_requant(model, parse_type(recipe.quantize.attn), [parse_rule(r) for r in recipe.quantize.types])
    assert all(p.new_type == p.tensor.ggml_type for p in plan.tensors if p.role.value == "expert")
    assert any(p.requantize for p in plan.tensors)
    if recipe.arch in ("deepseek2", "deepseek32"):
        k_b = [p for p in plan.tensors if ".attn_k_b." in p.tensor.name]
        assert k_b and all(p.new_type == T.Q8_0 and "attn_k_b=Q8_0" in p.reason for p in k_b)
    if recipe.arch == "lfm2moe":  # the short-convolution layers' projections, the taps left alone
        conv = {p.tensor.name.split(".")[3]: p for p in plan.tensors if ".shortconv." in p.tensor.name}
        assert all(conv[part].requantize and "shortconv" in conv[part].reason for part in ("in_proj", "out_proj"))
        assert not conv["conv"].requantize


def test_every_recipe_explains_its_choices() -> None:
    for path in RECIPES:
        text = path.read_text()
        comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
        assert len(comments) >= 5, path.name
        assert "moeprep prepare recipes/" in text, path.name  # how to run it


def test_defaults_and_types() -> None:
    r = parse_recipe(GOOD, "t.toml")
    assert r.quantize.attn == "Q5_K" and r.quantize.imatrix is True and r.quantize.types == ("token_embd=Q8_0",)
    assert r.calibration.chunks == 8 and r.calibration.ctx == 512 and r.calibration.dataset == "wikitext"
    assert r.publish.tags == () and r.publish.base_model is None


@pytest.mark.parametrize(
    "text, message",
    [
        ('name = "x"\narch = "qwen3moe"\ncolour = 1', "unknown key colour"),
        ('name = "x"\narch = "qwen3moe"\n[calibration]\nchunk = 3', "unknown key calibration.chunk"),
        ('name = "x"\narch = "qwen3moe"\n[calibration]\nctx = "512"', "calibration.ctx must be an integer"),
        ('name = "x"\narch = "qwen3moe"\n[calibration]\nchunks = true', "calibration.chunks must be an integer"),
        ('name = "x"\narch = "qwen3moe"\n[calibration]\nholdout = 1', "calibration.holdout: 1 is not in [0, 1)"),
        ('name = "x"\narch = "qwen3moe"\n[calibration]\nctx = 1', "calibration.ctx: 1 is below 2"),
        ('name = "x"\narch = "qwen3moe"\n[quantize]\nimatrix = "yes"', "quantize.imatrix must be true or false"),
        ('name = "x"\narch = "qwen3moe"\n[quantize]\ntypes = [1]', "quantize.types must be a list of strings"),
        ('name = "x"\narch = "qwen3moe"\n[quantize]\ntypes = "a=Q8_0"', "quantize.types must be a list of strings"),
        ('name = "x"\narch = "qwen3moe"\n[quantize]\nattn = "Q3_Q"', "quantize.attn: 'Q3_Q': not a type"),
        (
            'name = "x"\narch = "qwen3moe"\n[quantize]\ntypes = ["(=Q8_0"]',
            "quantize.types: --type '(=Q8_0': bad regular",
        ),
        ('name = "x"\narch = "qwen3moe"\n[publish]\nbase_model = "a b"', "publish.base_model: 'a b' is not a Hugging"),
        (
            'name = "x"\narch = "qwen3moe"\n[publish]\nsplit_max_size = "big"',
            "publish.split_max_size: 'big': not a size",
        ),
        ('name = "x"\narch = "qwen3moe"\nquantize = 3', "quantize must be a table"),
        ('name = "x"\narch = "mamba"', "arch: 'mamba' is not an architecture moeprep knows"),
        ('arch = "qwen3moe"', "missing key name"),
        ('name = "x"', "missing key arch"),
        ('name = "x"\narch = ', "not valid TOML"),
    ],
)
def test_bad_recipe_is_one_line_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(MoeprepError) as e:
        parse_recipe(text, "r.toml")
    assert str(e.value).startswith("r.toml: ") and message in str(e.value) and "\n" not in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MoeprepError, match="no such recipe file"):
        load_recipe(tmp_path / "none.toml")


def test_overrides(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(GOOD + 'dataset = "wikitext"\nconfig = "wikitext-103-raw-v1"\n')
    r = load_recipe(path, {"calibration.chunks": 3, "calibration.ctx": None, "publish.base_model": "Org/Model"})
    assert r.calibration.chunks == 3 and r.calibration.ctx == 512 and r.publish.base_model == "Org/Model"
    assert r.calibration.config == "wikitext-103-raw-v1"
    # another dataset does not have the file's dataset configuration
    other = load_recipe(path, {"calibration.dataset": "text.txt"})
    assert other.calibration.dataset == "text.txt" and other.calibration.config is None
    with pytest.raises(MoeprepError, match="calibration.chunks: 0 is below 1"):
        load_recipe(path, {"calibration.chunks": 0})
    with pytest.raises(MoeprepError, match="cannot override calibration.colour"):
        load_recipe(path, {"calibration.colour": 1})


def test_published_text_records_overrides(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(GOOD)
    assert recipe_text(load_recipe(path)) == GOOD
    text = recipe_text(load_recipe(path, {"calibration.chunks": 3, "calibration.dataset": "my text.txt"}))
    assert text.startswith(GOOD.rstrip("\n"))
    assert "# calibration.chunks = 3" in text and '# calibration.dataset = "my text.txt"' in text
    assert tomllib.loads(text) == tomllib.loads(GOOD)  # comments only: the file's own values are unchanged


def test_schema_sections_are_the_dataclasses() -> None:
    assert set(SECTIONS) == {"quantize", "calibration", "publish"}
