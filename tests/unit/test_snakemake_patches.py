"""The patches of Snakemake's internals (rules/snakemake_patches.smk), each against the contract
of what it replaces, in this process on the pinned Snakemake. What each saves is counted in a
real plan (tests/workflow/test_plan_cost.py); here, that each gives what Snakemake would."""

from __future__ import annotations

import runpy

import pytest
import snakemake
import snakemake.api  # first: snakemake.rules imports it back
import snakemake.rules

from tests.conftest import REPO


@pytest.fixture
def patches():
    """The include's functions, not applied (it applies them only inside a Snakefile)."""
    return runpy.run_path(str(REPO / "rules" / "snakemake_patches.smk"))


def test_the_patches_were_measured_on_the_pinned_snakemake(patches):
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"snakemake=={patches["SNAKEMAKE_MEASURED"]}"' in pyproject
    assert snakemake.__version__ == patches["SNAKEMAKE_MEASURED"]


def test_one_wildcards_object_per_job_is_keyed_by_names_and_values(patches, monkeypatch):
    """build_wildcards_once shares one Wildcards object among the functions of jobs with the
    same wildcards: the same names with the same values. Two jobs whose values are equal under
    other names (a shard '00001' of one rule, a part '00001' of another) each get their own
    names: keyed by values alone, the second would read the first's names."""
    monkeypatch.setattr(snakemake.rules, "Wildcards", snakemake.rules.Wildcards)  # undone after
    patches["build_wildcards_once"]()
    build = snakemake.rules.Wildcards
    assert getattr(build, "builds_once", False)
    shard = build(fromdict={"dataset": "web", "shard": "00001"})
    part = build(fromdict={"dataset": "web", "part": "00001"})
    assert shard.shard == "00001" and part.part == "00001"
    assert not hasattr(part, "shard") and not hasattr(shard, "part")
    assert build(fromdict={"dataset": "web", "shard": "00001"}) is shard  # shared
    assert build(fromdict={"shard": "00001", "dataset": "web"}) is not shard  # another order
    unhashable = build(fromdict={"dataset": ["web"]})
    assert unhashable.dataset == ["web"]  # built as Snakemake builds it
