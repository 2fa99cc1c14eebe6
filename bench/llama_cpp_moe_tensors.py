"""Write tests/gguf/llama_cpp_moe_tensors.json: every MoE architecture llama.cpp knows, with the tensors it loads.

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/lcp && tar xzf /tmp/lcp/*.tar.gz -C /tmp
    python bench/llama_cpp_moe_tensors.py /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp

The tests check moeprep's role tables (moeprep/gguf/arch_table.py) against this file offline, so they need neither
the source package nor a network. Read from llama.cpp's sources as data:
- src/llama-arch.cpp: LLM_ARCH_NAMES (enum -> GGUF architecture name), LLM_TENSOR_NAMES (enum -> tensor name
  pattern) and LLM_TENSOR_INFOS (enum -> the layer kind and the ggml op that uses the weight);
- src/llama-model.cpp: llama_model_mapping (enum -> model class), and the shared loader functions
  create_tensor_qkv and create_tensor_gate_up_exps (the tensors they create, expanded where a loader uses them);
- src/models/models.h: each model class's parent (a class without its own loader uses its parent's);
- src/models/*.cpp: each class's load_arch_tensors, whose tn(LLM_TENSOR_..., "suffix") expressions name
  its tensors.
An architecture is MoE when its loader creates a stacked-expert tensor (an *_EXPS or *_CHEXPS one), which only a
graph that builds a MoE FFN reads.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "gguf" / "llama_cpp_moe_tensors.json"
SHARED_LOADERS = {  # shared loader function -> the (tensor enum, suffix) pairs it may create (src/llama-model.cpp)
    "create_tensor_qkv": [
        ("LLM_TENSOR_ATTN_QKV", "weight"),
        ("LLM_TENSOR_ATTN_QKV", "bias"),
        ("LLM_TENSOR_ATTN_Q", "weight"),
        ("LLM_TENSOR_ATTN_K", "weight"),
        ("LLM_TENSOR_ATTN_V", "weight"),
        ("LLM_TENSOR_ATTN_Q", "bias"),
        ("LLM_TENSOR_ATTN_K", "bias"),
        ("LLM_TENSOR_ATTN_V", "bias"),
    ],
    "create_tensor_gate_up_exps": [
        ("LLM_TENSOR_FFN_GATE_UP_EXPS", "weight"),
        ("LLM_TENSOR_FFN_GATE_EXPS", "weight"),
        ("LLM_TENSOR_FFN_UP_EXPS", "weight"),
    ],
}


def table(text: str, name: str, value: str) -> dict[str, str]:
    """`{ KEY, value },` rows of the C++ map named `name`."""
    body = text[text.index(name) :]
    body = body[: body.index("};")]
    return dict(re.findall(r"\{\s*(LLM_[A-Z0-9_]+)\s*,\s*" + value + r"\s*\}", body))


def function_bodies(text: str, qualified: str) -> list[str]:
    """The bodies of every definition of `qualified(...)` in `text`, by brace matching."""
    bodies = []
    for m in re.finditer(re.escape(qualified) + r"\s*\([^)]*\)\s*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        bodies.append(text[m.end() : i - 1])
    return bodies


def loader_tensors(body: str) -> set[tuple[str, str | None]]:
    """(enum, suffix) pairs a loader body names; suffix None where tn() has no string suffix (e.g. ssm_a)."""
    found: set[tuple[str, str | None]] = set()
    for enum, suffix in re.findall(r"\btn\(\s*(LLM_TENSOR_[A-Z0-9_]+)\s*(?:,\s*\"([a-z_]+)\")?", body):
        found.add((enum, suffix or None))
    # enums handed to a local lambda that builds tn(tid, "weight", i) (glm5-next's and kimi-k3's conv loaders)
    if re.search(r"\btn\(\s*[a-z_]+\s*,\s*\"weight\"", body):
        for enum in re.findall(r"\(\s*(LLM_TENSOR_[A-Z0-9_]+)\s*\)", body):
            found.add((enum, "weight"))
    for function, pairs in SHARED_LOADERS.items():
        if re.search(r"\b" + function + r"\s*\(", body):
            found.update(pairs)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    src = args.llama_cpp / "src"
    arch_cpp = (src / "llama-arch.cpp").read_text()
    arch_names = table(arch_cpp, "LLM_ARCH_NAMES", r'"([^"]+)"')
    tensor_names = table(arch_cpp, "LLM_TENSOR_NAMES", r'"([^"]+)"')
    infos = {
        k: v.split(",")
        for k, v in table(
            arch_cpp, "LLM_TENSOR_INFOS", r"\{\s*(LLM_TENSOR_LAYER_[A-Z]+\s*,\s*GGML_OP_[A-Z_]+)\s*\}"
        ).items()
    }
    model_cpp = (src / "llama-model.cpp").read_text()
    classes = dict(re.findall(r"case (LLM_ARCH_[A-Z0-9_]+):\s*return new (llama_model_[a-z0-9_]+)\(", model_cpp))
    parents = dict(
        re.findall(
            r"struct (llama_model_[a-z0-9_]+)\s*:\s*public (llama_model_[a-z0-9_]+)",
            (src / "models" / "models.h").read_text(),
        )
    )
    sources = {p: p.read_text() for p in sorted((src / "models").glob("*.cpp"))}

    def loader(cls: str) -> tuple[str, list[str]]:
        while True:
            for path, text in sources.items():
                bodies = function_bodies(text, f"{cls}::load_arch_tensors")
                if bodies:
                    return path.name, bodies
            cls = parents[cls]

    archs, kinds = {}, {}
    for enum, cls in sorted(classes.items(), key=lambda kv: arch_names[kv[0]]):
        file, bodies = loader(cls)
        pairs = set().union(*(loader_tensors(b) for b in bodies))
        if not any(e.endswith(("_EXPS", "_CHEXPS")) for e, _ in pairs):
            continue
        names = []
        for e, suffix in pairs:
            name = tensor_names[e].replace("blk.%d.", "blk.{i}.") + (f".{suffix}" if suffix else "")
            layer, op = (s.strip() for s in infos[e])
            kinds[name] = [
                e.removeprefix("LLM_TENSOR_"),
                layer.removeprefix("LLM_TENSOR_LAYER_"),
                op.removeprefix("GGML_OP_"),
            ]
            names.append(name)
        archs[arch_names[enum]] = {"source": f"src/models/{file}", "tensors": sorted(names)}
    # one line per architecture and per tensor: small diffs when llama.cpp changes
    lines = [
        '{"llama_cpp": "llama-cpp-python 0.3.36 (vendored llama.cpp)",',
        ' "tensors": {  "//": "name -> [tensor enum, layer kind, ggml op] (src/llama-arch.cpp)",',
    ]
    lines += [f"  {json.dumps(n)}: {json.dumps(kinds[n])}," for n in sorted(kinds)]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "architectures": {']
    lines += [f"  {json.dumps(a)}: {json.dumps(v)}," for a, v in archs.items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" }", "}"]
    args.out.write_text("\n".join(lines) + "\n")
    json.loads(args.out.read_text())
    print(f"{len(archs)} MoE architectures, {len(kinds)} tensor names -> {args.out}")


if __name__ == "__main__":
    main()
