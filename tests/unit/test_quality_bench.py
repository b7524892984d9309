"""bench/quality.py --smoke runs in seconds and its figures hold together: the spaCy
signals decide as DataTrove does on every document, the rates are positive and the ratios
are theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gptflow.data.quality.filters import RULES

pytest.importorskip("datatrove")
pytest.importorskip("spacy")

REPO = Path(__file__).resolve().parents[2]


def test_the_smoke_bench_prints_its_figures_and_agreement():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--smoke", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    assert "per-document agreement with DataTrove" in out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["documents"] == 40 and figures["mib"] > 0.05
    rate = figures["mib_per_s"]
    assert all(value > 0 for value in rate.values())
    assert figures["ratio_regex_to_datatrove"] == pytest.approx(
        rate["signals_regex"] / rate["datatrove_four_filters"]
    )
    assert figures["agreement"]["spacy"] == dict.fromkeys(RULES, 1.0)
    assert set(figures["agreement"]["regex"]) == set(RULES)
    assert all(0.8 <= a <= 1 for a in figures["agreement"]["regex"].values())
