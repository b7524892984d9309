"""Snakemake adapter: a run's harness records -> its harness tables and curve."""

from gptflow.errors import report_errors
from gptflow.results.report import harness_report

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    harness_report(
        sm.params.run,
        sm.input.final,
        list(sm.input.steps),
        page=sm.output.page,
        curve=sm.output.curve,
    )
