"""The .moeprof file: exact round trip, determinism, and one clear refusal for every kind of damage."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard

from moeprep.errors import MoeprepError
from moeprep.profile.format import MAGIC, PREAMBLE, VERSION, decode_profile, encode_profile, read_profile, write_profile
from moeprep.profile.profile import Profile, Provenance
from tests.profile.conftest import make_profile


def assert_same(a: Profile, b: Profile) -> None:
    assert a.model == b.model and a.sources == b.sources
    assert a.counts.layers == b.counts.layers
    for x, y in [
        (a.counts.selections, b.counts.selections),
        (a.counts.gate_mass, b.counts.gate_mass),
        (a.counts.tokens, b.counts.tokens),
        (a.trace.ids, b.trace.ids),
        (a.trace.starts, b.trace.starts),
        (a.trace.heldout, b.trace.heldout),
    ]:
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (a.heldout is None) == (b.heldout is None)
    if a.heldout:
        assert np.array_equal(a.heldout.hits, b.heldout.hits) and a.heldout.slots == b.heldout.slots
        assert np.array_equal(a.heldout.lookups, b.heldout.lookups)


def test_round_trip(tmp_path: Path, profile: Profile) -> None:
    write_profile(tmp_path / "p.moeprof", profile)
    assert_same(read_profile(tmp_path / "p.moeprof"), profile)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temp file left


def test_round_trip_without_heldout() -> None:
    p = make_profile(heldout=0)
    assert p.heldout is None
    assert_same(decode_profile(encode_profile(p), "p"), p)


def test_chunks_asked_round_trips_and_older_or_newer_sources_read() -> None:
    """chunks_asked survives the file; a source written before it existed reads as None, and a key this version
    does not know is skipped."""
    p = make_profile()
    short = Provenance(**{**p.sources[0].to_dict(), "chunks_asked": 200})
    p.sources[0] = short
    assert decode_profile(encode_profile(p), "p").sources == [short] and short.short_of_text
    older = {k: v for k, v in short.to_dict().items() if k != "chunks_asked"}
    assert Provenance.from_dict(older).chunks_asked is None and not Provenance.from_dict(older).short_of_text
    assert Provenance.from_dict({**older, "a_later_key": 1}) == Provenance.from_dict(older)


def test_bytes_are_deterministic() -> None:
    assert encode_profile(make_profile(seed=4)) == encode_profile(make_profile(seed=4))


def _repack(data: bytes, payload: bytes) -> bytes:
    """A file around `payload` with a valid preamble and checksum (to reach the checks behind the checksum)."""
    return PREAMBLE.pack(MAGIC, VERSION, 0, len(payload), hashlib.sha256(payload).digest()) + payload


def _corrupt_header(data: bytes, edit) -> bytes:  # noqa: ANN001
    raw = zstandard.ZstdDecompressor().decompress(data[PREAMBLE.size :])
    (n,) = struct.unpack_from("<Q", raw)
    header = edit(raw[8 : 8 + n].decode())
    payload = struct.pack("<Q", len(header)) + header.encode() + raw[8 + n :]
    return _repack(data, zstandard.ZstdCompressor().compress(payload))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: b"GGUF" + d[4:], "not a moeprep profile"),
        (lambda d: d[:10], "not a moeprep profile"),
        (lambda d: d[:-7], "truncated"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
        (lambda d: d[:8] + struct.pack("<I", VERSION + 1) + d[12:], "newer than this moeprep"),
        (lambda d: _repack(d, b"not zstd at all"), "damaged profile"),
        (lambda d: _corrupt_header(d, lambda h: h.replace('"n_expert": 16', '"n_expert": 8')), "damaged profile"),
        (lambda d: _corrupt_header(d, lambda h: h.replace('"<i8"', '"<c16"', 1)), "unknown dtype"),
        (
            lambda d: _corrupt_header(d, lambda h: h.replace('"offset": 0', '"offset": 99999999', 1)),
            "outside the payload",
        ),
        (lambda d: _corrupt_header(d, lambda h: h[:-5]), "damaged profile"),
    ],
)
def test_damage_is_refused(tmp_path: Path, profile: Profile, damage, message: str) -> None:  # noqa: ANN001
    path = tmp_path / "bad.moeprof"
    path.write_bytes(damage(encode_profile(profile)))
    with pytest.raises(MoeprepError, match=message) as e:
        read_profile(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MoeprepError, match="no such profile"):
        read_profile(tmp_path / "nope.moeprof")
