"""Snakemake adapter: a study's finished runs -> its comparison figures, fit.json and page."""

from gptflow.errors import report_errors
from gptflow.results.study_report import study_report

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    files = zip(sm.input.configs, sm.params.metrics, sm.input.done, strict=True)
    runs = {
        name: {"config": config, "metrics": metrics, "done": done}
        for name, (config, metrics, done) in zip(sm.params.runs, files, strict=True)
    }
    for name, harness in zip(sm.params.runs, sm.input.harness, strict=False):
        runs[name]["harness"] = harness  # eval.harness: each run's harness.json
    study_report(
        sm.params.study,
        runs,
        sm.params.out_dir,
        budgets=sm.params.budgets or None,
        quality=sm.input.quality[0] if sm.input.quality else None,  # data.quality's summary
        quality_page=sm.params.quality_page[0] if sm.params.quality_page else None,
    )
