"""Settings every test that runs llama.cpp needs."""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_api

_default_model_params = llama_cpp_api.llama_model_default_params


def _model_params_without_extra_buffers():
    """llama.cpp's defaults minus repacked/AMX weight buffers.

    Some of our machines' CPUs advertise AMX while their VM does not grant it, and llama.cpp's AMX path then dies
    with SIGILL on quantized weights. The plain CPU path computes the same model, so the oracle loses nothing.
    """
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


# Both names: the low-level API (tests/oracle.py) and the Llama class look the function up separately.
llama_cpp.llama_model_default_params = _model_params_without_extra_buffers
llama_cpp_api.llama_model_default_params = _model_params_without_extra_buffers
