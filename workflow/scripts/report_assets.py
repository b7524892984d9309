"""Snakemake adapter: a finished run -> the plots and run card of `snakemake --report`."""

from gptflow.errors import report_errors
from gptflow.results.report import plot_metrics, run_card

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    import json
    from pathlib import Path

    series = json.loads(Path(sm.input.done).read_text())["series"]
    plot_metrics(sm.params.metrics, series, sm.params.out_dir)
    run_card(
        run_yaml=sm.input.config,
        done=sm.input.done,
        evaluation=sm.input.evaluation,
        datasets=sm.params.datasets,
        container=sm.input.container[0] if sm.input.container else None,
        out=sm.output.card,
        hf_export=sm.input.hf,
        quality_page=sm.input.quality[0] if sm.input.quality else None,  # data.quality's page
    )
