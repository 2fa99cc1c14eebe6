"""glm-dsa's indexer layout: which block's selection each block attends over, from attention.indexer.types or,
without the key, from the training context, and the one-line refusals of a layout llama.cpp cannot run."""

from __future__ import annotations

import pytest

from moeprep.errors import MoeprepError
from moerun.models.glm_dsa import LONG_CONTEXT, indexer_sources


class Metadata:
    """The part of a GGUFModel indexer_sources reads."""

    arch, path = "glm-dsa", "m.gguf"

    def __init__(self, **kv) -> None:
        self.kv = {f"glm-dsa.{k}": v for k, v in kv.items()}

    def get(self, key: str, default=None):
        return self.kv.get(key, default)


def test_types_name_each_block_s_source():
    g = Metadata(**{"attention.indexer.types": [1, 0, 0, 1, 0, 1]})
    assert indexer_sources(g, 6) == [0, 0, 0, 3, 3, 5]


def test_without_types_every_block_has_its_own_below_a_long_context():
    assert indexer_sources(Metadata(context_length=202752), 5) == [0, 1, 2, 3, 4]


def test_without_types_a_long_context_takes_the_released_layout():
    sources = indexer_sources(Metadata(context_length=LONG_CONTEXT), 11)
    assert sources == [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10]


@pytest.mark.parametrize(
    ("types", "message"),
    [
        ([0, 1, 1], "DSA block 0 shares the indexer of an earlier DSA block, and there is none"),
        ([1, 0], "lists 2 blocks; the model has 3"),
    ],
)
def test_a_layout_llama_cpp_cannot_run_is_refused_in_one_line(types, message):
    with pytest.raises(MoeprepError, match=message) as e:
        indexer_sources(Metadata(**{"attention.indexer.types": types}), 3)
    assert "\n" not in str(e.value)
