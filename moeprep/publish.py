"""`moeprep publish`: a folder that `hf upload USER/REPO OUTDIR` turns into a complete model repo; and its check.

The folder holds the GGUF (llama.cpp shards, each under the Hub's file limit), README.md (a model card built with
huggingface_hub's ModelCard), the .moeprof, the imatrix, the recipe, and SHA256SUMS (`sha256sum -c` format) over
every other file. Layout and card contents: docs/publish.md.

Atomicity: the folder is built in a hidden sibling (moeprep.atomic) and renamed to OUTDIR only when complete, with
SHA256SUMS written last inside it, so an interrupted publish never leaves an OUTDIR that passes --check.
The user's model is never moved or written, and by default the folder shares no writable inode with it (an edit in
place of the folder's copy, as gguf-set-metadata makes, must not change the source): its files are reflinked where
the file system can (FICLONE: instant, blocks shared copy-on-write), else copied; hard links only on request. It is
re-split (write_gguf) instead when one of its files is over the size limit.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from gguf import GGUFType, Keys
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from tqdm import tqdm

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import Anatomy, describe_model, moe_geometry
from moeprep.gguf.reader import SPLIT_RE, GGUFModel, field_value, open_gguf
from moeprep.gguf.roles import TensorRole
from moeprep.gguf.writer import FileRange, _kernel_copy, write_gguf
from moeprep.profile.analysis import format_heldout
from moeprep.profile.export import EXPERT_USAGE_KEY
from moeprep.profile.format import read_profile
from moeprep.profile.identity import check_same_model, identify_model
from moeprep.profile.profile import Profile
from moeprep.quant.imatrix import QUANTIZE_IMATRIX_DATASET, QUANTIZE_IMATRIX_N_CHUNKS, read_imatrix
from moeprep.units import format_size, parse_size

HUB_MAX_FILE = 50 * 1000**3  # the Hub refuses files above 50 GB
# moeprep's G is 2**30: 46G = 49.4 GB, under the limit with room for the shard header. (llama.cpp's gguf-split
# reads "48G" as 48e9 bytes; the same text here would be 51.5 GB, over it.)
DEFAULT_SPLIT_MAX_SIZE = "46G"
SUMS_FILE = "SHA256SUMS"
CARD_FILE = "README.md"
HUB_URL = "https://huggingface.co/"
PIPELINE_TAG = "text-generation"
BASE_TAGS = ("gguf", "moe")
DEFAULT_QUANTIZED_BY = "moeprep"
PROMPT = "Why is the sky blue?"
# Card metadata read from the GGUF when the request does not set it: card key -> GGUF key.
CARD_FROM_GGUF = {
    "license": Keys.General.LICENSE,
    "license_name": Keys.General.LICENSE_NAME,
    "license_link": Keys.General.LICENSE_LINK,
    "language": Keys.General.LANGUAGES,
}
# `sha256sum` output: hash, then " " for text or "*" for binary mode, then the name
SUMS_LINE_RE = re.compile(r"^(?P<sha>[0-9a-f]{64}) [ *](?P<name>.+)$")
FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): make the destination share the source's blocks, copy-on-write
# FICLONE's answers for "this file system (or this pair of files) cannot share blocks": copy the bytes instead
NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF}
COPY_CHUNK = 64 << 20


def _is_repo_id(v: Any) -> bool:
    try:
        validate_repo_id(v)
    except (HFValidationError, TypeError):
        return False
    return True


# What --check requires of the card's YAML: key -> (accepts, what it should be).
CARD_REQUIRED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "base_model": (_is_repo_id, "a Hugging Face repo id (ORG/NAME)"),
    "base_model_relation": (lambda v: v == "quantized", "'quantized'"),
    "quantized_by": (lambda v: isinstance(v, str) and bool(v.strip()), "a name"),
    "pipeline_tag": (lambda v: v == PIPELINE_TAG, repr(PIPELINE_TAG)),
    "tags": (lambda v: isinstance(v, list) and set(BASE_TAGS) <= set(v), f"a list containing {', '.join(BASE_TAGS)}"),
    "license": (lambda v: v is None or isinstance(v, str), "a license id such as apache-2.0, or absent"),
    "language": (
        lambda v: v is None or all(isinstance(x, str) for x in (v if isinstance(v, list) else [v])),
        "a language code or a list of them, or absent",
    ),
}


@dataclass(frozen=True)
class PublishRequest:
    model: Path  # a GGUF, or the first shard of a split set
    outdir: Path  # must not exist, or be empty
    base_model: str | None = None  # None: from the GGUF's general.source.repo_url when it is a Hub URL
    quantized_by: str | None = None  # None: DEFAULT_QUANTIZED_BY
    profile: Path | None = None
    imatrix: Path | None = None
    recipe: Path | None = None
    split_max_size: int | None = None  # bytes per file; None: DEFAULT_SPLIT_MAX_SIZE
    tags: tuple[str, ...] = ()
    license: str | None = None  # None: the GGUF's general.license
    language: tuple[str, ...] = ()  # empty: the GGUF's general.languages
    repo_id: str | None = None  # where it will be uploaded: fills in the card's commands
    hardlink: bool = False  # hard-link the model's files (an edit in place of the folder then edits the source)
    progress: bool = True  # a progress bar over the bytes copied


@dataclass(frozen=True)
class PublishedFile:
    name: str
    size: int
    sha256: str


@dataclass
class Published:
    outdir: Path
    files: list[PublishedFile]  # every file but SHA256SUMS, sorted by name
    model_files: list[str]  # the GGUF's shards, in order
    placed: str  # how the model's files got there: a PLACED key
    profile_file: str | None  # the .moeprof's name in the folder


@dataclass
class CheckReport:
    folder: Path
    problems: list[str] = field(default_factory=list)
    files: int = 0  # files whose checksum matched
    model: str | None = None  # the model's first shard

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return (
                f"OK: {self.folder}: {self.files} files match {SUMS_FILE}; model {self.model} opens with every "
                f"shard; {CARD_FILE} metadata complete. Upload it with: hf upload USER/REPO {self.folder}"
            )
        return "\n".join(
            [f"FAILED: {self.folder}: {len(self.problems)} problem(s):", *(f"  - {p}" for p in self.problems)]
        )


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _published_file(path: Path) -> PublishedFile:
    return PublishedFile(path.name, path.stat().st_size, file_sha256(path))


def model_stem(path: Path) -> str:
    """'name-00001-of-00003.gguf' and 'name.gguf' -> 'name'."""
    m = SPLIT_RE.match(path.name)
    return m["prefix"] if m else path.name.removesuffix(".gguf")


def resolve_base_model(model: GGUFModel, given: str | None) -> str:
    """The card's base_model: as given, else the GGUF's source repo when it is on the Hub."""
    source = str(model.get(Keys.General.SOURCE_REPO_URL, ""))
    base = given or (source.removeprefix(HUB_URL).strip("/") if source.startswith(HUB_URL) else None)
    if base is None:
        raise MoeprepError(
            f"{model.path}: the GGUF does not name its Hugging Face source; give --base-model "
            "ORG/NAME (the model it was converted from)"
        )
    if not _is_repo_id(base):
        raise MoeprepError(f"--base-model {base!r}: not a Hugging Face repo id; write it as ORG/NAME")
    return base


def check_split_max_size(size: int | None) -> int:
    """The file size limit to publish with: `size`, or the default; refused when the Hub would refuse the files."""
    limit = parse_size(DEFAULT_SPLIT_MAX_SIZE) if size is None else size
    if limit > HUB_MAX_FILE:
        raise MoeprepError(
            f"--split-max-size {format_size(limit)}: over the Hub's 50 GB file limit; use "
            f"{DEFAULT_SPLIT_MAX_SIZE} or less"
        )
    return limit


# How publish_folder placed the model's files -> what the summary says. In this order, the first that applies to any
# of the files is the one to tell.
PLACED = {
    "hardlink": "hard-linked (--hardlink: an edit in place of the folder's files edits it too)",
    "copy": "copied (an edit of the folder's files leaves it unchanged)",
    "reflink": "reflinked (blocks shared copy-on-write: an edit of the folder's files leaves it unchanged)",
    "resplit": "re-split to fit the size limit (new files)",
}


def _copy(src: Path, dst: Path, on_bytes: Callable[[int], None]) -> str:
    """`dst`, a new file with src's bytes that shares no inode with it: a reflink where the file system has them,
    else a copy (in the kernel where it can: copy_file_range); returns the PLACED key."""
    size = src.stat().st_size
    with open(src, "rb") as s, open(dst, "xb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
            on_bytes(size)
            return "reflink"
        except OSError as e:
            if e.errno not in NO_REFLINK:
                raise
        if not _kernel_copy(d, FileRange(src, 0), size, on_bytes):
            while chunk := s.read(COPY_CHUNK):
                d.write(chunk)
                on_bytes(len(chunk))
    return "copy"


def _link(src: Path, dst: Path, on_bytes: Callable[[int], None]) -> str:
    """A hard link where the file system allows it (not across file systems), else a copy; returns the PLACED key."""
    try:
        os.link(src, dst)
    except OSError:
        return _copy(src, dst, on_bytes)
    on_bytes(src.stat().st_size)
    return "hardlink"


def _place_model(model: GGUFModel, stage: Path, limit: int, hardlink: bool, progress: bool) -> tuple[list[Path], str]:
    """The model's files in `stage` and how they got there: as they are when every file fits `limit`, else re-split."""
    if all(p.stat().st_size <= limit for p in model.shard_paths):
        place = _link if hardlink else _copy
        with tqdm(
            total=sum(p.stat().st_size for p in model.shard_paths),
            unit="B",
            unit_scale=True,
            desc="copy",
            disable=not progress,
        ) as bar:
            methods = {place(p, stage / p.name, bar.update) for p in model.shard_paths}
        return [stage / p.name for p in model.shard_paths], next(m for m in PLACED if m in methods)
    # write_gguf limits a shard's tensor bytes; leave room for the header and each tensor's alignment padding
    budget = limit - model.readers[0].data_offset - model.alignment * len(model.tensors)
    biggest = max(model.tensors, key=lambda t: t.n_bytes)
    if biggest.n_bytes > budget:
        raise MoeprepError(
            f"{model.path}: tensor {biggest.name} alone is {format_size(biggest.n_bytes)}, more than "
            f"a shard of {format_size(limit)} can hold; raise --split-max-size"
        )
    return write_gguf(stage / f"{model_stem(model.path)}.gguf", model, split_max_size=budget), "resplit"


def _check_outdir(outdir: Path) -> None:
    if outdir.exists() and (not outdir.is_dir() or any(outdir.iterdir())):
        raise MoeprepError(
            f"{outdir}: exists and is not an empty folder; publish writes a new folder: remove it or choose another"
        )
    if not outdir.parent.is_dir():
        raise MoeprepError(f"{outdir.parent}: no such folder")


def publish_folder(req: PublishRequest) -> Published:
    """Write the upload folder `req.outdir` (see the module docstring)."""
    limit = check_split_max_size(req.split_max_size)
    _check_outdir(req.outdir)
    model = open_gguf(req.model)
    moe_geometry(model)  # refuses a GGUF without experts before anything is written
    base_model = resolve_base_model(model, req.base_model)
    profile = read_profile(req.profile) if req.profile else None
    if profile is not None:
        check_same_model(profile.model, identify_model(model), str(req.profile), str(req.model))
    if req.imatrix:
        read_imatrix(req.imatrix)  # refuse a file that is not one
    if req.recipe and not req.recipe.is_file():
        raise MoeprepError(f"{req.recipe}: no such recipe file")

    with atomic_output(req.outdir) as stage:  # replaces an empty OUTDIR; the folder appears complete or not at all
        stage.mkdir()
        shards, placed = _place_model(model, stage, limit, req.hardlink, req.progress)
        stem = model_stem(shards[0])
        extras: dict[str, Path] = {}
        if req.profile:
            extras[f"{stem}.moeprof"] = req.profile
        if req.imatrix:
            extras[f"{stem}.imatrix{req.imatrix.suffix}"] = req.imatrix
        if req.recipe:
            extras[req.recipe.name] = req.recipe
        for name, src in extras.items():
            shutil.copyfile(src, stage / name)
        result = Published(
            req.outdir,
            [_published_file(p) for p in sorted(stage.iterdir())],
            [p.name for p in shards],
            placed,
            f"{stem}.moeprof" if req.profile else None,
        )
        build_card(model, req, base_model, result, profile).save(stage / CARD_FILE)
        result.files = sorted([*result.files, _published_file(stage / CARD_FILE)], key=lambda f: f.name)
        (stage / SUMS_FILE).write_text("".join(f"{f.sha256}  {f.name}\n" for f in result.files), encoding="utf-8")
    return result


def format_published(result: Published, repo_id: str | None = None) -> str:
    lines = [
        f"wrote {result.outdir}; model {PLACED[result.placed]}",
        *(f"  {f.name:<48} {format_size(f.size):>12}  {f.sha256[:16]}" for f in result.files),
        f"  {SUMS_FILE}",
        f"check it:  moeprep publish --check {result.outdir}",
        f"upload it: hf upload {repo_id or 'USER/REPO'} {result.outdir}"
        "   (older huggingface_hub: huggingface-cli upload, same arguments)",
    ]
    return "\n".join(lines)


# --- the model card -----------------------------------------------------------------------------------------------


def card_metadata(model: GGUFModel, req: PublishRequest, base_model: str) -> ModelCardData:
    from_gguf = {key: model.get(gguf_key) for key, gguf_key in CARD_FROM_GGUF.items()}
    given = {"license": req.license, "language": list(req.language) or None}
    meta = {k: given.get(k) or v for k, v in from_gguf.items()}
    tags = [*BASE_TAGS, model.arch, "moeprep", *(["imatrix"] if model.get(QUANTIZE_IMATRIX_DATASET) else []), *req.tags]
    return ModelCardData(
        base_model=base_model,
        base_model_relation="quantized",
        quantized_by=req.quantized_by or DEFAULT_QUANTIZED_BY,
        pipeline_tag=PIPELINE_TAG,
        tags=list(dict.fromkeys(tags)),
        **meta,
    )


def _what_was_done(model: GGUFModel, base_model: str, anatomy: Anatomy, recipe: Path | None) -> list[str]:
    geo = anatomy.geometry
    lines = [
        f"[{base_model}]({HUB_URL}{base_model}) in GGUF ({model.arch}: {geo.n_layer} layers, {geo.n_expert} "
        f"experts per MoE layer, {geo.n_expert_used} per token), prepared with moeprep for expert-cached "
        "inference:",
        "",
    ]
    attn = model.get("moeprep.attn_type")
    if attn is not None:
        rules = model.get("moeprep.type_rules") or []
        lines.append(
            f"- attention requantized to {attn}"
            + (f", rules {', '.join(f'`{r}`' for r in rules)}" if rules else "")
            + "; routed experts kept byte for byte"
        )
    dataset = model.get(QUANTIZE_IMATRIX_DATASET)
    if dataset is not None:
        chunks = model.get(QUANTIZE_IMATRIX_N_CHUNKS)
        lines.append(
            f"- importance matrix from `{public_dataset_name(dataset)}`" + (f", {chunks} chunks" if chunks else "")
        )
    if model.get(EXPERT_USAGE_KEY) is not None:
        lines.append(
            f"- expert-usage counts baked into the GGUF as `{EXPERT_USAGE_KEY}`: the warm start of an expert cache"
        )
    if recipe is not None:
        lines.append(f"- recipe: `{recipe.name}`")
    return lines


LOCAL_TEXT_SUFFIXES = {".txt", ".raw", ".jsonl", ".json", ".parquet"}


def public_dataset_name(dataset: str) -> str:
    """A dataset as a public card shows it: a Hub name as it is, a local file or folder by its last name only (the
    provenance keeps the path given, as llama-imatrix does, but a card should not publish the preparer's folders)."""
    path = Path(dataset)
    if path.is_absolute() or dataset.startswith((".", "~")) or path.suffix in LOCAL_TEXT_SUFFIXES:
        return path.name
    return dataset


def _files_table(files: list[PublishedFile]) -> list[str]:
    return [
        "| File | Size | SHA256 |",
        "|---|---:|---|",
        *(f"| `{f.name}` | {format_size(f.size)} | `{f.sha256}` |" for f in files),
    ]


def _types_table(anatomy: Anatomy) -> list[str]:
    rows = ["| Role | Tensors | Size | Types |", "|---|---:|---:|---|"]
    for role in TensorRole:
        s = anatomy.roles.get(role.value)
        if s is not None:
            types = ", ".join(f"{name} x{n}" for name, n in sorted(s.types.items(), key=lambda kv: -kv[1]))
            rows.append(f"| {role.value} | {s.n_tensors} | {format_size(s.n_bytes)} | {types} |")
    return rows


def _profile_section(profile: Profile, name: str) -> list[str]:
    texts = [
        f"{' '.join(x for x in (public_dataset_name(s.dataset), s.config, s.split) if x)}: "
        f"{s.chunks} chunks x {s.ctx} tokens "
        f"counted, {s.heldout_chunks} held out"
        + (f" (the text gave only these, of the {s.chunks_asked} chunks asked)" if s.short_of_text else "")
        for s in profile.sources
    ]
    return [
        "## Expert-usage profile",
        "",
        f"`{name}` records which experts each MoE layer chose on " + "; ".join(texts) + ". The held-out chunks "
        "were never counted: they were replayed through simulated per-layer expert caches (sizes as shares of a "
        "layer's experts) to show how well the profile carries over to new text:",
        "",
        "```",
        format_heldout(profile.heldout),
        "```",
    ]


def _usage_section(repo: str, first: str, profile_name: str | None, baked: bool) -> list[str]:
    local = repo.rsplit("/", 1)[-1]
    model = f"{local}/{first}"
    lines = [
        "## Use it",
        "",
        "```bash",
        "# download (older huggingface_hub releases: huggingface-cli download, same arguments)",
        f"hf download {repo} --local-dir {local}",
        "",
        "# moerun, moeprep's runtime (on a GPU, experts that do not fit VRAM stay in RAM: the expert cache)",
        f'moerun -m {model} -p "{PROMPT}" -n 128 --device cuda'
        + (f" --expert-profile {local}/{profile_name}" if profile_name else ""),
        "",
        "# a smaller card: cap the VRAM per GPU; moerun bench prints the cache's hit rate and speed",
        f"moerun bench -m {model} --device cuda --vram-budget 24G"
        + (f" --expert-profile {local}/{profile_name}" if profile_name else ""),
        "",
        "# or serve it over the OpenAI API at http://127.0.0.1:8080/v1 (any OpenAI client; 4 requests batched)",
        f"moerun serve -m {model} -c 8192 --parallel 4",
        "",
        "# stock llama.cpp: give the first shard, it finds the others",
        f'llama-cli -m {model} -p "{PROMPT}" -n 128',
        "",
    ]
    if baked:
        lines += [
            "# llama.cpp expert-cache fork: the same command; it reads the baked "
            f"{EXPERT_USAGE_KEY} as its cache's warm start",
            f'llama-cli -m {model} -p "{PROMPT}" -n 128',
            "",
        ]
    lines += ["# check the download", f"cd {local} && sha256sum -c {SUMS_FILE}", "```"]
    if profile_name:
        lines += [
            "",
            f"`--expert-profile {profile_name}` fills moerun's expert cache with this profile's hottest "
            "experts before the first token and splits the slots between layers by its counts; the cache "
            "stays adaptive after that. Stock llama.cpp ignores the profile and the baked key.",
        ]
    return lines


def build_card(
    model: GGUFModel, req: PublishRequest, base_model: str, published: Published, profile: Profile | None
) -> ModelCard:
    """The card for `published` (its files so far: the card lists every file but itself and SHA256SUMS)."""
    anatomy = describe_model(model)
    body = [
        f"# {model.name} GGUF (moeprep)",
        "",
        *_what_was_done(model, base_model, anatomy, req.recipe),
        "",
        "## Files",
        "",
        *_files_table(published.files),
        "",
        f"`{SUMS_FILE}` lists the same checksums (and this card's) for `sha256sum -c`.",
        "",
        "## Tensor types",
        "",
        *_types_table(anatomy),
        "",
        *(_profile_section(profile, published.profile_file) + [""] if profile else []),
        *_usage_section(
            req.repo_id or "USER/REPO",
            published.model_files[0],
            published.profile_file,
            model.get(EXPERT_USAGE_KEY) is not None,
        ),
    ]
    data = card_metadata(model, req, base_model)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


# --- the check ----------------------------------------------------------------------------------------------------


def _folder_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {SUMS_FILE}


def _check_sums(folder: Path, report: CheckReport) -> None:
    sums = folder / SUMS_FILE
    if not sums.is_file():
        report.problems.append(f"{SUMS_FILE}: missing (an interrupted publish?); publish again")
        return
    listed: dict[str, str] = {}
    for i, line in enumerate(sums.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        m = SUMS_LINE_RE.match(line)
        if m is None:
            report.problems.append(f"{SUMS_FILE}: line {i} is not '<sha256>  <file>'")
        else:
            listed[m["name"]] = m["sha"]
    present = _folder_files(folder)
    report.problems += [f"{name}: in the folder but not in {SUMS_FILE}" for name in sorted(present - listed.keys())]
    for name, sha in listed.items():
        if name not in present:
            report.problems.append(f"{name}: listed in {SUMS_FILE} but missing")
        elif file_sha256(folder / name) != sha:
            report.problems.append(f"{name}: sha256 does not match {SUMS_FILE} (changed or damaged)")
        else:
            report.files += 1


def _gguf_sets(folder: Path) -> dict[str, list[Path]]:
    """GGUF files grouped by split set: first shard's name -> files claiming to belong to it."""
    sets: dict[str, list[Path]] = {}
    for p in sorted(folder.glob("*.gguf")):
        m = SPLIT_RE.match(p.name)
        first = f"{m['prefix']}-00001-of-{m['count']}.gguf" if m else p.name
        sets.setdefault(first, []).append(p)
    return sets


def _check_model(folder: Path, report: CheckReport) -> GGUFModel | None:
    models: list[GGUFModel] = []
    for first, members in _gguf_sets(folder).items():
        try:
            model = open_gguf(folder / first)
        except MoeprepError as e:
            report.problems.append(str(e))
            continue
        if model.get(Keys.General.TYPE) == GGUFType.IMATRIX:
            continue
        models.append(model)
        extra = sorted({p.name for p in members} - {p.name for p in model.shard_paths})
        report.problems += [f"{name}: not a shard of {first}" for name in extra]
    if len(models) != 1:
        report.problems.append(f"{len(models)} models in the folder; publish puts exactly one GGUF model there")
        return None
    model = models[0]
    for i, (path, reader) in enumerate(zip(model.shard_paths, model.readers, strict=True)):
        if path.stat().st_size > HUB_MAX_FILE:
            report.problems.append(f"{path.name}: {format_size(path.stat().st_size)}, over the Hub's 50 GB file limit")
        no = reader.get_field(Keys.Split.LLM_KV_SPLIT_NO)
        if len(model.shard_paths) > 1 and (no is None or field_value(no) != i):
            report.problems.append(f"{path.name}: split.no is not {i}")
    tensors = model.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if len(model.shard_paths) > 1 and tensors != len(model.tensors):
        report.problems.append(
            f"{model.path.name}: split.tensors.count {tensors} but the shards hold {len(model.tensors)} tensors"
        )
    try:
        moe_geometry(model)
    except MoeprepError as e:
        report.problems.append(str(e))
    report.model = model.path.name
    return model


def _check_card(folder: Path, report: CheckReport) -> None:
    path = folder / CARD_FILE
    if not path.is_file():
        report.problems.append(f"{CARD_FILE}: missing")
        return
    try:
        data = ModelCard.load(path).data.to_dict()
    except (ValueError, yaml.YAMLError) as e:
        report.problems.append(f"{CARD_FILE}: metadata does not parse ({str(e).splitlines()[0]})")
        return
    for key, (accepts, what) in CARD_REQUIRED.items():
        if not accepts(data.get(key)):
            report.problems.append(f"{CARD_FILE}: {key} is {data.get(key)!r}; it should be {what}")


def _check_profiles(folder: Path, model: GGUFModel, report: CheckReport) -> None:
    identity = identify_model(model)
    for path in sorted(folder.glob("*.moeprof")):
        try:
            check_same_model(read_profile(path).model, identity, path.name, model.path.name)
        except MoeprepError as e:
            report.problems.append(str(e))


def check_folder(folder: Path) -> CheckReport:
    """Everything `hf upload` needs to be right before it starts: checksums, shards, card metadata, profile."""
    if not folder.is_dir():
        raise MoeprepError(f"{folder}: no such folder; give the folder `moeprep publish` wrote")
    report = CheckReport(folder)
    _check_sums(folder, report)
    model = _check_model(folder, report)
    _check_card(folder, report)
    if model is not None:
        _check_profiles(folder, model, report)
    return report
