"""A study's comparison (gptflow.results.study_report), in results/studies/{study}/ and in
`snakemake --report`: a data ablation's recipes on the shared held-out text with each one's
data-quality funnel, a size study's fitted scaling laws and compute-optimal sizes, every run's
validation loss against tokens and training FLOPs, the final loss per learning rate. With
data.quality, `study` also makes the data-quality page, which the study page links."""


rule study:
    input:
        get_study_outputs(),
        get_quality_page(),


# It reads each run's metrics.jsonl (not an output: the trainer appends to it while it runs)
# after the run's DONE.json, written last; with eval.harness, each run's harness.json too.
rule study_report:
    input:
        configs=expand(paths.RUN_YAML, run=PLAN.runs),
        done=expand(paths.DONE, run=PLAN.runs),
        harness=expand(paths.HARNESS, run=PLAN.runs) if PLAN.harness["tasks"] else [],
        # data.quality: what each recipe keeps (a data ablation's funnels; the page links it)
        quality=[paths.QUALITY_SUMMARY] if PLAN.quality_step else [],
    output:
        loss_tokens=report(
            f"{paths.STUDY_DIR}/loss_tokens.svg",
            caption="../workflow/report/study_loss_tokens.rst",
            category="Study",
            labels={"study": "{study}", "figure": "loss against tokens"},
        ),
        loss_flops=report(
            f"{paths.STUDY_DIR}/loss_flops.svg",
            caption="../workflow/report/study_loss_flops.rst",
            category="Study",
            labels={"study": "{study}", "figure": "loss against FLOPs"},
        ),
        loss_lr=report(
            f"{paths.STUDY_DIR}/loss_lr.svg",
            caption="../workflow/report/study_loss_lr.rst",
            category="Study",
            labels={"study": "{study}", "figure": "loss against learning rate"},
        ),
        fit=report(
            f"{paths.STUDY_DIR}/fit.svg",
            caption="../workflow/report/study_fit.rst",
            category="Study",
            labels={"study": "{study}", "figure": "scaling law"},
        ),
        optimizers=report(
            f"{paths.STUDY_DIR}/optimizers.svg",
            caption="../workflow/report/study_optimizers.rst",
            category="Study",
            labels={"study": "{study}", "figure": "optimizers"},
        ),
        fit_json=f"{paths.STUDY_DIR}/fit.json",
        page=report(
            STUDY_PAGE,
            caption="../workflow/report/study.rst",
            category="Study",
            labels={"study": "{study}", "figure": "study page"},
        ),
    log:
        paths.log("study_report", "{study}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        study=PLAN.study,
        runs=list(PLAN.runs),
        metrics=expand(paths.METRICS, run=PLAN.runs),
        out_dir=paths.STUDY_DIR,
        budgets=(PLAN.config.get("study") or {}).get("budgets", []),
        quality_page=get_quality_page(),
    script:
        "../workflow/scripts/study_report.py"
