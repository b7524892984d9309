"""Snakemake adapter: the validated workflow config + tokenizer + shards -> run.yaml."""

import sys

from gptflow.errors import report_errors
from gptflow.train.run_config import render_run_config, write_run_config

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    run = render_run_config(
        sm.params.settings,
        tokenizer_path=sm.input.tokenizer,
        shards=sm.params.shards,
        run_dir=sm.params.run_dir,
        data_index=sm.params.data_index,
        heldout=sm.params.heldout,
        origins=sm.params.origins,
    )
    write_run_config(run, sm.output[0])
    series = run.series if run.train.precision != "auto" else "named on the training device"
    print(f"run {run.run}: series {series}, {run.extra}", file=sys.stderr)
