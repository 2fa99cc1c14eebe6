"""Where moeprep's numba kernels cache their machine code (moeprep.quant.jit)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numba

from moeprep.quant import jit


def test_numba_cache_falls_back_to_the_temp_dir(tmp_path: Path, monkeypatch):
    """With the package folder and numba's user cache read-only the kernels' cache goes to the temp dir, where numba
    alone would fail at import; with no writable folder at all they compile in memory (see _numba_cache_usable)."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(jit, "_writable", lambda folder: folder.parent == tmp_path)
    assert jit._numba_cache_usable()
    assert Path(numba.config.CACHE_DIR).parent == tmp_path and os.environ["NUMBA_CACHE_DIR"] == numba.config.CACHE_DIR
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(jit, "_writable", lambda folder: False)
    assert not jit._numba_cache_usable()
