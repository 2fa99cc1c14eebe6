"""Calibration text through the real `datasets` code paths, on local files only (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

from moeprep.errors import MoeprepError
from moeprep.profile.dataset import DatasetSpec, calibration_chunks, load_rows, make_chunks, text_pieces

BOS = 1000


def encode(text: str, add_bos: bool) -> list[int]:
    """A byte tokenizer: token = byte value, BOS = 1000."""
    return [BOS] * add_bos + list(text.encode())


def stream(spec: DatasetSpec) -> str:
    return "".join(text_pieces(load_rows(spec), spec.text_column, spec.name))


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


TEXT = "first line\n\nsecond line\nthird\n"


def test_txt_keeps_the_file_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    assert stream(DatasetSpec(str(tmp_path / "a.txt"))) == TEXT  # rows keep their line breaks: the file exactly


def test_jsonl_and_parquet_rows(tmp_path: Path) -> None:
    rows = [{"text": "alpha", "id": 1}, {"text": "beta\n", "id": 2}, {"text": "", "id": 3}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert stream(DatasetSpec(str(tmp_path / "a.jsonl"))) == "alpha\nbeta\n"
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    assert stream(DatasetSpec(str(tmp_path / "a.parquet"))) == "alpha\nbeta\n"
    with pytest.raises(MoeprepError, match="no column 'body'; pass --text-column, one of: text"):
        stream(DatasetSpec(str(tmp_path / "a.jsonl"), text_column="body"))


def test_folder_of_files_and_saved_dataset(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "train.txt").write_text("one\ntwo\n")
    assert stream(DatasetSpec(str(folder))) == "one\ntwo\n"
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
            "test": datasets.Dataset.from_dict({"text": ["held"]}),
        }
    ).save_to_disk(str(saved))
    assert stream(DatasetSpec(str(saved), split="test")) == "held\n"
    with pytest.raises(MoeprepError, match="cannot load this dataset"):
        stream(DatasetSpec(str(saved), split="validation"))


def test_downloaded_hub_repository_with_configs(tmp_path: Path) -> None:
    """A dataset repository cloned from the Hub (how wikitext is laid out): configs declared in README.md."""
    repo = tmp_path / "wikitext"
    (repo / "wikitext-2-raw-v1").mkdir(parents=True)
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n"
        "  - split: train\n    path: wikitext-2-raw-v1/train-*\n---\n"
    )
    datasets.Dataset.from_dict({"text": ["", " = Title = \n", " Body text .\n"]}).to_parquet(
        str(repo / "wikitext-2-raw-v1" / "train-00000-of-00001.parquet")
    )
    assert stream(DatasetSpec(str(repo), "wikitext-2-raw-v1")) == " = Title = \n Body text .\n"


def test_chunks_like_llama_imatrix(tmp_path: Path) -> None:
    tokens = np.arange(23)
    chunks = make_chunks(tokens, 5, BOS)
    assert chunks.shape == (4, 5) and (chunks[:, 0] == BOS).all() and chunks[1, 1:].tolist() == [6, 7, 8, 9]
    assert make_chunks(tokens, 5, None, max_chunks=2).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    (tmp_path / "a.txt").write_text("x" * 100)
    got = calibration_chunks(DatasetSpec(str(tmp_path / "a.txt")), encode, BOS, 10, 3)
    assert got.shape == (3, 10) and got[0, 0] == BOS and (got[:, 1:] == ord("x")).all()
    with pytest.raises(MoeprepError, match="only 102 tokens, less than one chunk of --ctx 200"):
        calibration_chunks(DatasetSpec(str(tmp_path / "a.txt")), encode, BOS, 200, None)


def test_bad_local_paths(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(MoeprepError, match="unknown text file type '.csv'"):
        load_rows(DatasetSpec(str(tmp_path / "a.csv")))
    with pytest.raises(MoeprepError, match="missing.txt: no such file"):
        load_rows(DatasetSpec(str(tmp_path / "missing.txt")))


def test_wikitext_offline_without_cache_says_what_to_do(tmp_path: Path) -> None:
    """The real load_dataset("wikitext", "wikitext-2-raw-v1") call, offline with an empty cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = (
        "from moeprep.profile.dataset import DatasetSpec, load_rows\n"
        "from moeprep.errors import MoeprepError\n"
        "try:\n    load_rows(DatasetSpec('wikitext'))\nexcept MoeprepError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("wikitext: not in the local Hugging Face cache and the Hub cannot be reached")
    assert "--dataset wiki.train.raw" in out and out.count("\n") == 1
    assert DatasetSpec("wikitext").resolved_config == "wikitext-2-raw-v1"
