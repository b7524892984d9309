"""megatron-core's compiled dataset helpers, the independent reference for our blend index
(tests and bench/blend_index.py)."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import numpy as np


def helpers_cpp():
    """megatron-core's compiled helpers, loaded from its file: importing megatron.core for it
    costs seconds (torch); compiled by megatron-core's own Makefile if its wheel lacked it."""
    pattern = "megatron/core/datasets/helpers_cpp*.so"
    found = [f for p in sys.path for f in glob.glob(os.path.join(p or ".", pattern))]
    if not found:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
        from megatron.core.datasets import helpers_cpp

        return helpers_cpp
    spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_blend(helpers, weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """What megatron-core's BlendedDataset builds: weights normalized, C++ greedy."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, w, len(w), size, False)
    return dataset_index, dataset_sample_index
