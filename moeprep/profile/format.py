"""The .moeprof file: a versioned, checksummed, zstd-compressed profile (layout in docs/profile-format.md).

    file    = magic "MOEPROF\\0" | u32 version | u32 flags (0) | u64 payload bytes | sha256(payload) | payload
    payload = zstd( u64 header bytes | header (UTF-8 JSON) | arrays )

The JSON header holds the identity, provenance and held-out metadata and, for every array, its dtype, shape and
byte offset in the array area (little endian, C order, 8-byte aligned). The checksum covers the compressed payload,
so a damaged file is refused before anything is decompressed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError
from moeprep.profile.counts import ExpertCounts
from moeprep.profile.heldout import HeldoutTable
from moeprep.profile.identity import ModelIdentity
from moeprep.profile.profile import Profile, Provenance
from moeprep.profile.trace import RoutingTrace

MAGIC = b"MOEPROF\0"
VERSION = 1
PREAMBLE = struct.Struct("<8sIIQ32s")  # magic, version, flags, payload bytes, sha256 of payload
ALIGN = 8
ZSTD_LEVEL = 9
# dtypes an array may declare: anything else is a damaged or foreign file
DTYPES = {"<i8", "<f8", "|u1", "<u2", "|b1"}


def _arrays(p: Profile) -> dict[str, np.ndarray]:
    arrays = {
        "counts.selections": p.counts.selections,
        "counts.gate_mass": p.counts.gate_mass,
        "counts.tokens": p.counts.tokens,
        "trace.ids": p.trace.ids,
        "trace.starts": p.trace.starts,
        "trace.heldout": p.trace.heldout,
    }
    if p.heldout is not None:
        arrays |= {"heldout.hits": p.heldout.hits, "heldout.lookups": p.heldout.lookups}
    return arrays


def _heldout_meta(h: HeldoutTable) -> dict[str, Any]:
    return {
        "slots": list(h.slots),
        "chunks": h.chunks,
        "tokens": h.tokens,
        "policies": list(h.policies),
        "sizes": list(h.sizes),
        "windows": list(h.windows),
    }


def encode_profile(p: Profile) -> bytes:
    area, table = bytearray(), {}
    for name, a in _arrays(p).items():
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        area += b"\0" * (-len(area) % ALIGN)
        table[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": len(area)}
        area += a.tobytes()
    header = json.dumps(
        {
            "model": p.model.to_dict(),
            "sources": [s.to_dict() for s in p.sources],
            "heldout": _heldout_meta(p.heldout) if p.heldout else None,
            "arrays": table,
        }
    ).encode()
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(struct.pack("<Q", len(header)) + header + bytes(area))
    return PREAMBLE.pack(MAGIC, VERSION, 0, len(payload), hashlib.sha256(payload).digest()) + payload


def write_profile(path: str | Path, p: Profile) -> None:
    """Write atomically: a temp file beside `path`, renamed into place."""
    path = Path(path)
    if not path.parent.exists():
        raise MoeprepError(f"{path.parent}: output folder does not exist")
    with atomic_output(path) as tmp:
        tmp.write_bytes(encode_profile(p))


def read_profile(path: str | Path) -> Profile:
    """Read and validate a .moeprof; anything damaged, truncated or foreign is one MoeprepError."""
    path = Path(path)
    if not path.is_file():
        raise MoeprepError(f"{path}: no such profile file")
    return decode_profile(path.read_bytes(), str(path))


def decode_profile(data: bytes, where: str) -> Profile:
    damaged = f"{where}: damaged profile"
    redo = "write it again with `moeprep profile`"
    if len(data) < PREAMBLE.size or not data.startswith(MAGIC):
        raise MoeprepError(f"{where}: not a moeprep profile (bad magic); give a .moeprof written by `moeprep profile`")
    _, version, _, size, digest = PREAMBLE.unpack_from(data)
    if version > VERSION:
        raise MoeprepError(
            f"{where}: profile format version {version} is newer than this moeprep's ({VERSION}); upgrade moeprep"
        )
    payload = data[PREAMBLE.size :]
    if len(payload) != size:
        raise MoeprepError(f"{damaged} (truncated: {len(payload)} of {size} payload bytes); {redo}")
    if hashlib.sha256(payload).digest() != digest:
        raise MoeprepError(f"{damaged} (checksum mismatch); {redo}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload)
        (n_header,) = struct.unpack_from("<Q", raw)
        header = json.loads(raw[8 : 8 + n_header])
        area = memoryview(raw)[8 + n_header :]
        arrays = {name: _array(area, spec) for name, spec in header["arrays"].items()}
        p = _build(header, arrays)
    except (
        zstandard.ZstdError,
        struct.error,
        json.JSONDecodeError,
        UnicodeDecodeError,
        KeyError,
        TypeError,
        ValueError,
    ) as e:
        raise MoeprepError(f"{damaged} ({type(e).__name__}: {e}); {redo}") from e
    _validate(p, where)
    return p


def _array(area: memoryview, spec: dict[str, Any]) -> np.ndarray:
    if spec["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {spec['dtype']}")
    dtype, shape, offset = np.dtype(spec["dtype"]), tuple(int(d) for d in spec["shape"]), int(spec["offset"])
    n_bytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if offset < 0 or offset + n_bytes > len(area) or any(d < 0 for d in shape):
        raise ValueError(f"array of shape {shape} at {offset} lies outside the payload")
    return np.frombuffer(area[offset : offset + n_bytes], dtype).reshape(shape).copy()


def _build(header: dict[str, Any], a: dict[str, np.ndarray]) -> Profile:
    model = ModelIdentity.from_dict(header["model"])
    counts = ExpertCounts(model.moe_layers, a["counts.selections"], a["counts.gate_mass"], a["counts.tokens"])
    trace = RoutingTrace(a["trace.ids"], a["trace.starts"], a["trace.heldout"].astype(bool))
    meta = header["heldout"]
    heldout = (
        None
        if meta is None
        else HeldoutTable(
            layers=model.moe_layers,
            slots=tuple(meta["slots"]),
            hits=a["heldout.hits"],
            lookups=a["heldout.lookups"],
            chunks=meta["chunks"],
            tokens=meta["tokens"],
            policies=tuple(meta["policies"]),
            sizes=tuple(meta["sizes"]),
            windows=tuple(meta["windows"]),
        )
    )
    return Profile(model, [Provenance.from_dict(s) for s in header["sources"]], counts, trace, heldout)


def _validate(p: Profile, where: str) -> None:
    """Shapes agree with the identity; a file that parses but disagrees with itself is damaged."""
    m, e = len(p.model.moe_layers), p.model.n_expert
    t = p.trace
    problems = [
        (p.counts.selections.shape != (m, e), f"counts shape {p.counts.selections.shape} is not ({m}, {e})"),
        (p.counts.gate_mass.shape != (m, e) or p.counts.tokens.shape != (m,), "gate mass or token counts misshapen"),
        (t.ids.ndim != 3 or t.ids.shape[1] != m, f"trace shape {t.ids.shape} does not have {m} layers"),
        (
            len(t.starts) != len(t.heldout) + 1
            or t.starts[0] != 0
            or t.starts[-1] != len(t.ids)
            or (np.diff(t.starts) < 0).any(),
            "trace chunk boundaries inconsistent",
        ),
        (t.ids.size > 0 and int(t.ids.max()) >= e, f"trace has expert ids beyond {e} experts"),
        (
            p.heldout is not None
            and p.heldout.hits.shape != (len(p.heldout.policies), len(p.heldout.sizes), len(p.heldout.windows), m),
            "held-out table misshapen",
        ),
    ]
    bad = [msg for failed, msg in problems if failed]
    if bad:
        raise MoeprepError(f"{where}: damaged profile ({bad[0]}); write it again with `moeprep profile`")
