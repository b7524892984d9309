"""What a plan leaves for ``gptflow why`` (:mod:`gptflow.watch.why`): after every successful
run, the validated config it used (:data:`RECORD`, written by the Snakefile's onsuccess); in
``why``'s own dry run, the config and the preflight this plan would use now, written where the
environment variables :data:`DUMP_ENV` and :data:`DUMP_PREFLIGHT_ENV` say.

Planning writes them (gptflow.plan.build, rules/setup.smk) and ``why`` reads them, so they live
here, below both: the command that compares them watches runs and sits above planning.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

RECORD = Path(".snakemake") / "gptflow" / "last-config.yaml"
DUMP_ENV = "GPTFLOW_DUMP_CONFIG"
DUMP_PREFLIGHT_ENV = "GPTFLOW_DUMP_PREFLIGHT"


def dump_config(cfg: dict) -> None:
    """Write `cfg` where the environment variable DUMP_ENV says (set by `why`'s dry run)."""
    from gptflow.fsutil import atomic_write

    path = os.environ.get(DUMP_ENV)
    if path:
        with atomic_write(path) as f:
            yaml.safe_dump(cfg, f, sort_keys=False)


def dump_preflight(report) -> None:
    """Write the plan's preflight (gptflow.plan.preflight.Report) where DUMP_PREFLIGHT_ENV says."""
    from gptflow.fsutil import write_json

    path = os.environ.get(DUMP_PREFLIGHT_ENV)
    if path:
        write_json(path, report.to_json())


def record_config(cfg: dict, workdir: str | os.PathLike = ".") -> None:
    """After a successful run (the Snakefile's onsuccess): the config `why` compares against.

    Plain dicts and lists are written: Snakemake reads a JSON config file into OrderedDicts,
    which yaml.safe_dump refuses (every run with a JSON --configfile failed here)."""
    import time

    from gptflow.config.schema import plain
    from gptflow.fsutil import atomic_write

    path = Path(workdir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": plain(cfg)}
        yaml.safe_dump(record, f, sort_keys=False)
