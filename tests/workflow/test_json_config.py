"""A JSON --configfile works as the YAML one does: it plans, runs a job, and the run's config is
recorded for `gptflow why` (Snakemake reads JSON into OrderedDicts, which once failed the
onsuccess handler, so every run exited 1). Keys given twice are refused, in JSON as in YAML."""

import json

import yaml

from gptflow.plan.records import RECORD

from .conftest import REPO, job_counts


def tiny() -> dict:
    return yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())


def test_a_json_configfile_plans_runs_and_is_recorded(tmp_path, snakemake):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny(), indent=2))
    wd = tmp_path / "wd"
    target = "results/documents/stdlib/00000.jsonl"  # one cheap job: collect stdlib files

    plan = snakemake(wd, config, "-n", target)
    assert plan.returncode == 0, plan.out
    assert job_counts(plan.out) == {"collect_local_documents": 1}

    run = snakemake(wd, config, target)
    assert run.returncode == 0, run.out
    assert (wd / target).stat().st_size > 0
    record = yaml.safe_load((wd / RECORD).read_text())
    assert record["config"]["run"] == "tiny"
    assert record["config"]["data"]["blend"] == [{"dataset": "stdlib", "weight": 1.0}]
    assert record["config"]["model"]["hidden_size"] == 64  # the resolved config


def test_a_key_given_twice_in_a_json_configfile_stops_the_plan(tmp_path, snakemake):
    text = json.dumps(tiny(), indent=2)
    # the second "lr" is the one Snakemake's JSON reader would keep
    text = text.replace('"lr": 0.003,', '"lr": 0.003,\n    "lr": 0.3,', 1)
    config = tmp_path / "twice.json"
    config.write_text(text)
    line = text.splitlines().index('    "lr": 0.3,') + 1

    out = snakemake(tmp_path / "wd", config, "-n")
    assert out.returncode != 0
    lines = [x for x in out.out.splitlines() if x.startswith("gptflow config:")]
    assert lines == [
        f"gptflow config: {config}:{line}: key 'train.lr' is given twice (first on line "
        f"{line - 1}); only the last would count. Remove one of them from {config}."
    ], out.out
    assert not (tmp_path / "wd" / "results").exists()
