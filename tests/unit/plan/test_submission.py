"""Refused submissions (gptflow.plan.submission): the reason copied into the log Snakemake points
at, from Snakemake's own error blocks (their shape as the Slurm plugin 2.8.0 prints them)."""

from gptflow.plan.submission import record_refusals, refused_submissions

BLOCK = """Error in rule {rule}:
    message: {message}
    sbatch call:
        sbatch --parsable --job-name gptflow_6763940c -A default -p debug -C nonexistent
For further error details see the cluster/cloud log and the log files of the involved rule(s).
    jobid: 0
    output: results/documents/stdlib/00000.jsonl
    log: {log} (check log file(s) for error details)
Logfile {log}: empty file
"""
SBATCH = ("SLURM sbatch failed. The error message was 'sbatch: error: Batch job submission "
          "failed: Invalid feature specification'.")  # fmt: skip
PLUGIN = ("Job submission failed with exception: For MPI jobs, 'tasks_per_node' must be "
          "greater than 1.")  # fmt: skip


def test_refusals_are_found_per_job_log_with_their_attempts():
    text = "Building DAG of jobs...\n" + "".join(
        [BLOCK.format(rule="collect_local_documents", message=SBATCH, log="logs/c/0.log")] * 4
        + [BLOCK.format(rule="train_gpt", message=PLUGIN, log="logs/train_gpt/tiny.log")]
        + [BLOCK.format(rule="tokenize_shard", message="Command exited with 1", log="logs/t.log")]
    )
    found = refused_submissions(text)
    assert [(r.rule, r.log, r.message, r.attempts) for r in found] == [
        ("collect_local_documents", "logs/c/0.log", SBATCH, 4),
        ("train_gpt", "logs/train_gpt/tiny.log", PLUGIN, 1),
    ]  # a job that ran and failed is not a refused submission


def test_the_reason_lands_in_the_job_log(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text(BLOCK.format(rule="train_gpt", message=SBATCH, log="logs/train_gpt/x.log") * 2)
    assert record_refusals(log, tmp_path) == 1
    assert (tmp_path / "logs/train_gpt/x.log").read_text() == (
        "gptflow: Slurm never ran this train_gpt job: its submission was refused 2 time(s) "
        f"with\n  {SBATCH}\nFix what that names (often the profile: partition, account, gres, "
        "time, constraint, QOS) and run again.\n"
    )
    assert record_refusals(tmp_path / "missing.log", tmp_path) == 0
