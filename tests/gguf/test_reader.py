"""Our GGUF header parser against gguf-py's GGUFReader, key by key and tensor by tensor, on a real-size vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, Keys

from moeprep.gguf.reader import StringArray, open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from tests.conftest import REAL_VOCAB


def test_metadata_and_tensors_equal_gguf_readers(real_vocab_model: Path) -> None:
    ours, theirs = open_gguf(real_vocab_model), GGUFReader(real_vocab_model)
    expected = {name: f for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for name, f in expected.items():
        field = ours.fields[name]
        assert field.types == f.types, name
        assert field.value == f.contents(), name
        assert (field.offset, field.nbytes) == (f.offset, sum(int(p.nbytes) for p in f.parts)), name
    assert len(ours.get(Keys.Tokenizer.LIST)) == len(ours.get(Keys.Tokenizer.TOKEN_TYPE)) == REAL_VOCAB
    assert ours.readers[0].data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [(t.name, t.ggml_type, t.shape, t.n_bytes, t.offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), int(t.n_bytes), int(t.data_offset))
        for t in theirs.tensors
    ]


def test_string_arrays_decode_on_first_use(real_vocab_model: Path) -> None:
    field = open_gguf(real_vocab_model).fields[Keys.Tokenizer.LIST]
    tokens = field.contents
    assert isinstance(tokens, StringArray) and "value" not in vars(field)  # nothing decoded by opening
    assert tokens[0] == "<|endoftext|>" and tokens[-1] == f"<unused{REAL_VOCAB - 2048 - 1}>"
    assert tokens[2048:2050] == ["<unused0>", "<unused1>"]
    with pytest.raises(IndexError):
        tokens[REAL_VOCAB]
    assert field.value == tokens.tolist() == [tokens[i] for i in range(0, REAL_VOCAB)]


def test_every_value_type_round_trips(tmp_path: Path, dense_model: Path) -> None:
    """Each GGUF value type, scalar and array (an empty one too), as gguf-py reads it back."""
    V = GGUFValueType
    values = {
        V.UINT8: 7,
        V.INT8: -7,
        V.UINT16: 700,
        V.INT16: -700,
        V.UINT32: 70000,
        V.INT32: -70000,
        V.UINT64: 1 << 40,
        V.INT64: -(1 << 40),
        V.FLOAT32: 0.5,
        V.FLOAT64: 0.25,
        V.BOOL: True,
        V.STRING: "é",
    }
    keys = {f"test.{t.name.lower()}": KVValue(v, t) for t, v in values.items()}
    keys |= {f"test.array.{t.name.lower()}": KVValue([v, v], V.ARRAY, t) for t, v in values.items()}
    keys["test.array.empty"] = KVValue([], V.ARRAY, V.STRING)
    out = write_gguf(tmp_path / "types.gguf", open_gguf(dense_model), kv_set=keys)[0]
    ours, theirs = open_gguf(out), GGUFReader(out)
    for key in keys:
        assert ours.get(key) == theirs.fields[key].contents(), key
        if key != "test.array.empty":  # gguf-py leaves an empty array's element type out of `types`
            assert ours.fields[key].types == theirs.fields[key].types, key
    assert ours.fields["test.array.empty"].types == [V.ARRAY, V.STRING]
    assert isinstance(ours.fields["test.array.float32"].contents, np.ndarray)  # numbers stay a view of the file
