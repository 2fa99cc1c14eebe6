"""`moeprep prepare RECIPE MODEL OUTDIR`: from a downloaded GGUF to an upload folder, in resumable steps.

  calibrate  profile MODEL on the recipe's text; the same pass writes the importance matrix
  quantize   requantize attention with that imatrix (experts byte for byte), verified against MODEL
  profile    profile the quantized model: the routing users will run, with its held-out table
  bake       copy the quantized model with the profile's counts as moe_cache.expert_usage
  publish    OUTDIR/upload, the folder `hf upload` takes (moeprep.publish)

OUTDIR/work/ holds the intermediate files and state.json. After each step, state.json records the step's inputs
(file fingerprints and the recipe settings it used) and its outputs' fingerprints. On a rerun a step whose record
matches (same inputs, same settings, outputs as it left them) is skipped; any other runs again, and its new outputs
are new inputs to the steps after it, so those run again too. An interrupted step left no record and reruns.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf, shard_paths_for
from moeprep.profile.dataset import DatasetSpec
from moeprep.profile.export import bake_profile
from moeprep.profile.format import read_profile, write_profile
from moeprep.profile.run import ProfileRequest, profile_model
from moeprep.publish import (
    PublishRequest,
    check_split_max_size,
    file_sha256,
    model_stem,
    publish_folder,
    resolve_base_model,
)
from moeprep.quant.imatrix import read_imatrix
from moeprep.quant.plan import parse_rule, parse_type, plan_requant
from moeprep.quant.quantize import quantize_model
from moeprep.recipe import Recipe, recipe_text
from moeprep.units import format_size, parse_size

STATE_VERSION = 1
# Files up to this size are known by their sha256; bigger ones (models) by size and mtime, since hashing hundreds
# of GB on every rerun would take longer than some of the steps it lets us skip.
HASHED_UP_TO = 64 << 20


@dataclass(frozen=True)
class PrepareJob:
    recipe: Recipe  # command-line overrides already applied
    model: Path
    outdir: Path
    repo_id: str | None = None  # for the card's commands
    device: str = "cpu"  # torch device of the calibration passes (does not change what a step produces)
    threads: int = 1  # quantizer threads (idem)

    def __post_init__(self) -> None:
        assert self.recipe.path is not None, "prepare publishes the recipe file: load it with load_recipe"

    @property
    def recipe_file(self) -> Path:
        assert self.recipe.path is not None
        return self.recipe.path

    @property
    def model_files(self) -> list[Path]:
        """Every shard of MODEL: a shard changing is the model changing."""
        return shard_paths_for(Path(self.model))

    @property
    def text_files(self) -> list[Path]:
        """The calibration text when it is local (a Hub dataset is known by its name, in the settings)."""
        local = DatasetSpec(self.recipe.calibration.dataset).local
        return [local] if local is not None else []

    @property
    def imatrix_used(self) -> list[Path]:
        return [self.imatrix] if self.recipe.quantize.imatrix else []

    @property
    def work(self) -> Path:
        return self.outdir / "work"

    @property
    def upload(self) -> Path:
        return self.outdir / "upload"

    @property
    def state_file(self) -> Path:
        return self.work / "state.json"

    @property
    def source_profile(self) -> Path:
        return self.work / "source.moeprof"  # the calibration pass's profile of MODEL, kept for comparison

    @property
    def imatrix(self) -> Path:
        return self.work / "imatrix.gguf"

    @property
    def quantized(self) -> Path:
        return self.work / "quantized.gguf"

    @property
    def profile(self) -> Path:
        return self.work / "quantized.moeprof"

    @property
    def baked(self) -> Path:
        """The published model's name: the source's, with the attention type."""
        return self.work / f"{model_stem(self.model)}-attn-{self.recipe.quantize.attn.upper()}.gguf"

    @property
    def recipe_copy(self) -> Path:
        return self.work / self.recipe_file.name


def _profile(job: PrepareJob, model: Path, out: Path, imatrix_out: Path | None) -> None:
    c = job.recipe.calibration
    spec = DatasetSpec(c.dataset, c.config, c.split, c.text_column)
    write_profile(
        out, profile_model(ProfileRequest(model, spec, c.ctx, c.chunks, None, c.holdout, job.device, imatrix_out))
    )


def run_calibrate(job: PrepareJob) -> None:
    _profile(job, job.model, job.source_profile, job.imatrix)


def run_quantize(job: PrepareJob) -> None:
    q = job.recipe.quantize
    source = open_gguf(job.model)
    plan = plan_requant(source, parse_type(q.attn), [parse_rule(r) for r in q.types])
    imatrix = read_imatrix(job.imatrix) if q.imatrix else None
    report = quantize_model(source, job.quantized, plan, imatrix=imatrix, threads=job.threads).report
    if not report.ok:
        raise MoeprepError(
            f"{job.quantized}: not written, it does not verify against {job.model} "
            f"({report.summary()}); the source may be damaged: check it with `moeprep verify`"
        )


def run_profile(job: PrepareJob) -> None:
    _profile(job, job.quantized, job.profile, None)


def run_bake(job: PrepareJob) -> None:
    bake_profile(read_profile(job.profile), str(job.profile), str(job.quantized), job.baked)


def publish_request(job: PrepareJob) -> PublishRequest:
    p = job.recipe.publish
    return PublishRequest(
        model=job.baked,
        outdir=job.upload,
        base_model=p.base_model,
        quantized_by=p.quantized_by,
        profile=job.profile,
        imatrix=job.imatrix if job.imatrix_used else None,
        recipe=job.recipe_copy,
        split_max_size=parse_size(p.split_max_size) if p.split_max_size else None,
        tags=p.tags,
        license=p.license,
        language=p.language,
        repo_id=job.repo_id,
    )


def run_publish(job: PrepareJob) -> None:
    if job.upload.exists():  # ours: the publish step's record names it (see _prepare_outdir)
        shutil.rmtree(job.upload)
    with atomic_output(job.recipe_copy) as tmp:
        tmp.write_text(recipe_text(job.recipe), encoding="utf-8")
    publish_folder(publish_request(job))


@dataclass(frozen=True)
class Step:
    name: str
    about: str
    run: Callable[[PrepareJob], None]
    inputs: Callable[[PrepareJob], list[Path]]
    outputs: Callable[[PrepareJob], list[Path]]
    settings: Callable[[PrepareJob], dict[str, Any]]
    enabled: Callable[[PrepareJob], bool] = lambda job: True


def _calibration(job: PrepareJob) -> dict[str, Any]:
    """The calibration settings, a local text by its absolute path (a rerun from another folder is the same run)."""
    text = job.text_files
    return {**dataclasses.asdict(job.recipe.calibration), **({"dataset": str(text[0].resolve())} if text else {})}


STEPS: list[Step] = [
    Step(
        "calibrate",
        "profile the source and compute the importance matrix",
        run_calibrate,
        inputs=lambda job: [*job.model_files, *job.text_files],
        outputs=lambda job: [job.source_profile, job.imatrix],
        settings=_calibration,
        enabled=lambda job: job.recipe.quantize.imatrix,
    ),
    Step(
        "quantize",
        "requantize attention, experts byte for byte",
        run_quantize,
        inputs=lambda job: [*job.model_files, *job.imatrix_used],
        outputs=lambda job: [job.quantized],
        settings=lambda job: dataclasses.asdict(job.recipe.quantize),
    ),
    Step(
        "profile",
        "profile the quantized model",
        run_profile,
        inputs=lambda job: [job.quantized, *job.text_files],
        outputs=lambda job: [job.profile],
        settings=_calibration,
    ),
    Step(
        "bake",
        "bake the profile into the GGUF",
        run_bake,
        inputs=lambda job: [job.quantized, job.profile],
        outputs=lambda job: [job.baked],
        settings=lambda job: {},
    ),
    Step(
        "publish",
        "write the upload folder",
        run_publish,
        inputs=lambda job: [job.baked, job.profile, *job.imatrix_used, job.recipe_file],
        outputs=lambda job: [job.upload],
        settings=lambda job: {
            **dataclasses.asdict(job.recipe.publish),
            "name": job.recipe.name,
            "overrides": job.recipe.overrides,
            "repo_id": job.repo_id,
        },
    ),
]


def fingerprint(path: Path) -> Any:
    """What a rerun compares a file or folder by (None when it is missing)."""
    if path.is_dir():
        return {p.relative_to(path).as_posix(): fingerprint(p) for p in sorted(path.rglob("*")) if p.is_file()}
    if not path.is_file():
        return None
    st = path.stat()
    if st.st_size <= HASHED_UP_TO:
        return {"size": st.st_size, "sha256": file_sha256(path)}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _key(job: PrepareJob, path: Path) -> str:
    """A path as the state file names it: relative to OUTDIR inside it (OUTDIR may move), else absolute."""
    path, outdir = path.resolve(), job.outdir.resolve()
    return path.relative_to(outdir).as_posix() if path.is_relative_to(outdir) else str(path)


def _record(job: PrepareJob, step: Step) -> dict[str, Any]:
    """The step's inputs and settings, as the state file records them."""
    return {
        "inputs": {_key(job, p): fingerprint(p) for p in step.inputs(job)},
        "settings": json.loads(json.dumps(step.settings(job))),
    }  # tuples as lists, as read back from JSON


def _outputs(job: PrepareJob, step: Step) -> dict[str, Any]:
    return {_key(job, p): fingerprint(p) for p in step.outputs(job)}


def read_state(job: PrepareJob) -> dict[str, Any]:
    try:
        state = json.loads(job.state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"version": STATE_VERSION, "steps": {}}
    except (OSError, json.JSONDecodeError) as e:
        raise MoeprepError(f"{job.state_file}: unreadable ({e}); delete it to start over") from e
    if state.get("version") != STATE_VERSION:
        raise MoeprepError(f"{job.state_file}: written by another moeprep version; delete it to start over")
    return state


def write_state(job: PrepareJob, state: dict[str, Any]) -> None:
    with atomic_output(job.state_file) as tmp:
        tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class StepResult:
    name: str
    status: str  # "ran", "skipped" (up to date) or "off" (disabled by the recipe)
    seconds: float


def _check_job(job: PrepareJob) -> None:
    """Refuse now what would otherwise fail after hours of calibration."""
    model = open_gguf(job.model)
    if model.arch != job.recipe.arch:
        raise MoeprepError(
            f"{job.model}: a {model.arch} model, but {job.recipe.path} is a recipe for "
            f"{job.recipe.arch}; use the recipe for {model.arch}"
        )
    resolve_base_model(model, job.recipe.publish.base_model)
    check_split_max_size(publish_request(job).split_max_size)
    if not job.outdir.parent.is_dir():
        raise MoeprepError(f"{job.outdir.parent}: no such folder")


def _prepare_outdir(job: PrepareJob, state: dict[str, Any]) -> None:
    """OUTDIR/upload may only exist if an earlier run's publish step made it: never delete the user's files."""
    if job.upload.exists() and "publish" not in state["steps"]:
        raise MoeprepError(
            f"{job.upload}: exists but was not written by moeprep prepare; move it away or choose another OUTDIR"
        )


def prepare(job: PrepareJob, log: Callable[[str], None] = lambda line: None) -> list[StepResult]:
    """Run the steps that are not up to date; `log` gets one line as each step starts and ends."""
    _check_job(job)
    made = [d for d in (job.outdir, job.work) if not d.exists()]
    job.work.mkdir(parents=True, exist_ok=True)
    try:
        state = read_state(job)
        _prepare_outdir(job, state)
        return _run_steps(job, state, log)
    except Exception:  # an error, not an interrupt: an interrupted run keeps its state.json to resume from
        _remove_if_nothing_done(job, made)
        raise


def _remove_if_nothing_done(job: PrepareJob, made: list[Path]) -> None:
    """A run that failed before any step finished takes back the folders it made (a bad model then leaves no OUTDIR
    behind); a folder holding anything else, or made by an earlier run, stays."""
    try:
        if not made or read_state(job)["steps"]:
            return
    except MoeprepError:
        return
    job.state_file.unlink(missing_ok=True)
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return


def _run_steps(job: PrepareJob, state: dict[str, Any], log: Callable[[str], None]) -> list[StepResult]:
    results = []
    for i, step in enumerate(STEPS, 1):
        head = f"[{i}/{len(STEPS)}] {step.name}"
        if not step.enabled(job):
            state["steps"].pop(step.name, None)
            results.append(StepResult(step.name, "off", 0.0))
            log(f"{head}: off in this recipe")
            continue
        record = _record(job, step)
        done = state["steps"].get(step.name, {})
        if all(done.get(k) == v for k, v in record.items()) and done.get("outputs") == _outputs(job, step):
            results.append(StepResult(step.name, "skipped", 0.0))
            log(f"{head}: up to date, skipped")
            continue
        log(f"{head}: {step.about}")
        state["steps"].pop(step.name, None)
        write_state(job, state)  # the old record goes before the step touches its outputs
        start = time.perf_counter()
        step.run(job)
        seconds = time.perf_counter() - start
        state["steps"][step.name] = {**record, "outputs": _outputs(job, step), "seconds": round(seconds, 2)}
        write_state(job, state)
        results.append(StepResult(step.name, "ran", seconds))
        log(f"{head}: done in {seconds:.1f} s")
    return results


def format_prepared(job: PrepareJob, results: list[StepResult]) -> str:
    ran = [r.name for r in results if r.status == "ran"]
    size = sum(p.stat().st_size for p in job.upload.iterdir())
    return "\n".join(
        [
            f"steps run: {', '.join(ran) or 'none (all up to date)'}",
            f"upload folder: {job.upload} ({format_size(size)})",
            f"check it:  moeprep publish --check {job.upload}",
            f"upload it: hf upload {job.repo_id or 'USER/REPO'} {job.upload}"
            "   (older huggingface_hub: huggingface-cli upload, same arguments)",
        ]
    )
