"""Autotune (the config's `autotune`; docs/autotune.md): the run's fastest layout, found by
timing it. Each candidate the preflight admits is a trial, a run of its own trained by the
train_gpt rule on the profile's ranks (results/runs/{run}.tune.*/DONE.json: cached, so a
search run again runs only the trials that did not finish); autotune_report ranks what they
measured. `snakemake autotune` runs the search; nothing else depends on it."""


rule autotune:
    input:
        get_autotune_outputs(),


rule autotune_report:
    input:
        done=lambda wildcards: expand(paths.DONE, run=PLAN.trials),
    output:
        json=paths.AUTOTUNE_JSON,
        page=report(
            paths.AUTOTUNE_PAGE,
            caption="../workflow/report/autotune.rst",
            category="Autotune",
            labels={"run": "{run}", "figure": "ranked layouts"},
        ),
        best=paths.AUTOTUNE_BEST,
    log:
        paths.log("autotune_report", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        candidates=[c.to_json() for c in PLAN.candidates],
        trials=list(PLAN.trials),
        metrics=expand(paths.METRICS, run=PLAN.trials),
        warmup_steps=(PLAN.autotune or {}).get("warmup_steps"),
    script:
        "../workflow/scripts/autotune_report.py"
