"""profiles/pbs/status.py, Snakemake's status command under the PBS profile, on canned `qstat -f
-x` records as PBS Pro (text) and Torque (XML) print them: finished, failed, killed at the
walltime, running, queued, held. No PBS server exists here: `qstat` is a script on PATH that
prints the record (as the Slurm status tests use a fake squeue), and PATH holds nothing else,
so no sacct answers in its place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

STATUS = Path(__file__).resolve().parents[2] / "profiles" / "pbs" / "status.py"
SUBMIT = (
    "-A proj -q {queue} -l {select},walltime=720:00{fs} -N gptflow_train_gpt -j oe -o "
    ".snakemake/pbs_logs/train_gpt-12.log -r y -V /home/alice/gptflow/.snakemake/tmp.q1w2e3/"
    "snakejob.train_gpt.12.sh"
)


def pbspro(state: str, substate: int, exit_status: int | None = None, comment: str = "") -> str:
    """`qstat -f -x 4107.pbs01` on PBS Pro: a job that ran has resources_used, exec_host and
    stime; a finished one Exit_status and history_timestamp; held, Hold_Types u. Long values
    wrap onto tab-indented lines (Variable_List: qsub -V passes the whole environment)."""
    ran = state in "RF"
    lines = ["Job Id: 4107.pbs01", "    Job_Name = gptflow_train_gpt",
             "    Job_Owner = alice@login01.cluster"]  # fmt: skip
    if ran:
        lines += [
            "    resources_used.cpupercent = 396", "    resources_used.cput = 01:02:13",
            "    resources_used.mem = 10484724kb", "    resources_used.ncpus = 32",
            "    resources_used.vmem = 35521384kb", "    resources_used.walltime = 00:16:02",
        ]  # fmt: skip
    lines += [f"    job_state = {state}", "    queue = gpu", "    server = pbs01",
              "    Account_Name = proj", "    Checkpoint = u",
              "    ctime = Tue Nov 18 09:12:41 2025",
              "    Error_Path = login01.cluster:/home/alice/gptflow/gptflow_train_gpt.e4107"]  # fmt: skip
    if ran:
        lines += ["    exec_host = x3001c0s13b0n0/0*32",
                  "    exec_vnode = (x3001c0s13b0n0:ncpus=32:ngpus=4)"]  # fmt: skip
    lines += [
        f"    Hold_Types = {'u' if state == 'H' else 'n'}", "    Join_Path = oe",
        "    Keep_Files = n", "    Mail_Points = a", "    mtime = Tue Nov 18 09:28:45 2025",
        "    Output_Path = login01.cluster:/home/alice/gptflow/.snakemake/pbs_logs/train_gpt-1",
        "\t2.log",
        "    Priority = 0", "    qtime = Tue Nov 18 09:12:41 2025", "    Rerunable = True",
        "    Resource_List.filesystems = home:eagle", "    Resource_List.ncpus = 32",
        "    Resource_List.ngpus = 4", "    Resource_List.nodect = 1",
        "    Resource_List.place = free", "    Resource_List.select = 1:system=polaris",
        "    Resource_List.walltime = 12:00:00",
    ]  # fmt: skip
    if ran:
        lines += ["    stime = Tue Nov 18 09:12:43 2025", "    session_id = 81234",
                  "    jobdir = /home/alice"]  # fmt: skip
    lines += [
        f"    substate = {substate}",
        "    Variable_List = PBS_O_HOME=/home/alice,PBS_O_LANG=en_US.UTF-8,",
        "\tPBS_O_LOGNAME=alice,PBS_O_PATH=/home/alice/gptflow/.venv/bin:/usr/bin:/bin,",
        "\tPBS_O_MAIL=/var/spool/mail/alice,PBS_O_SHELL=/bin/bash,",
        "\tPBS_O_WORKDIR=/home/alice/gptflow,PBS_O_SYSTEM=Linux,PBS_O_QUEUE=gpu,",
        "\tCONDA_DEFAULT_ENV=base,OMP_NUM_THREADS=8,PBS_O_HOST=login01.cluster",
        f"    comment = {comment}",
        "    etime = Tue Nov 18 09:12:41 2025",
    ]  # fmt: skip
    if ran:
        lines.append("    run_count = 1")
    if exit_status is not None:
        lines += ["    Stageout_status = 1", f"    Exit_status = {exit_status}"]
    submit = SUBMIT.format(
        queue="gpu", select="select=1:system=polaris", fs=",filesystems=home:eagle"
    )
    lines.append(f"    Submit_arguments = {submit[:60]}")
    lines += [f"\t{submit[i : i + 70]}" for i in range(60, len(submit), 70)]
    if state == "F":
        lines.append("    history_timestamp = 1763458125")
    lines += ["    project = _pbs_project_default", "    Submit_Host = login01.cluster", "", ""]
    return "\n".join(lines)


def torque(state: str, exit_status: int | None = None) -> str:
    """`qstat -f -x 4107.torque01` on Torque: XML on one line (after the declaration), times
    as epoch seconds; a completed job (C) has exit_status, comp_time and total_runtime."""
    ran = state in "RCE"
    used = ("<resources_used><cput>01:02:13</cput><energy_used>0</energy_used><mem>10484724kb"
            "</mem><vmem>35521384kb</vmem><walltime>00:16:02</walltime></resources_used>")  # fmt: skip
    submit = SUBMIT.format(queue="batch", select="nodes=1:ppn=8", fs="")
    parts = [
        "<Data><Job><Job_Id>4107.torque01</Job_Id><Job_Name>gptflow_train_gpt</Job_Name>",
        "<Job_Owner>alice@login01</Job_Owner>",
        used if ran else "",
        f"<job_state>{state}</job_state><queue>batch</queue><server>torque01</server>",
        "<Account_Name>proj</Account_Name><Checkpoint>u</Checkpoint><ctime>1763457161</ctime>",
        "<Error_Path>login01:/home/alice/gptflow/gptflow_train_gpt.e4107</Error_Path>",
        "<exec_host>node07/0-7</exec_host>" if ran else "",
        f"<Hold_Types>{'u' if state == 'H' else 'n'}</Hold_Types><Join_Path>oe</Join_Path>",
        "<Keep_Files>n</Keep_Files><Mail_Points>a</Mail_Points><mtime>1763458125</mtime>",
        "<Output_Path>login01:/home/alice/gptflow/.snakemake/pbs_logs/train_gpt-12.log",
        "</Output_Path><Priority>0</Priority><qtime>1763457161</qtime>",
        "<Rerunable>True</Rerunable><Resource_List><nodect>1</nodect><nodes>1:ppn=8</nodes>",
        "<walltime>12:00:00</walltime></Resource_List>",
        "<session_id>81234</session_id>" if ran else "",
        "<Variable_List>PBS_O_QUEUE=batch,PBS_O_HOME=/home/alice,PBS_O_LOGNAME=alice,",
        "PBS_O_PATH=/home/alice/gptflow/.venv/bin:/usr/bin:/bin,PBS_O_SHELL=/bin/bash,",
        "PBS_O_LANG=en_US.UTF-8,PBS_O_WORKDIR=/home/alice/gptflow,PBS_O_HOST=login01,",
        "PBS_O_SERVER=torque01,OMP_NUM_THREADS=8</Variable_List><euser>alice</euser>",
        "<egroup>alice</egroup><queue_type>E</queue_type><etime>1763457161</etime>",
        f"<exit_status>{exit_status}</exit_status>" if exit_status is not None else "",
        f"<submit_args>{submit}</submit_args>",
        "<start_time>1763457163</start_time><start_count>1</start_count>" if ran else "",
        "<fault_tolerant>False</fault_tolerant>",
        "<comp_time>1763458125</comp_time>" if state == "C" else "",
        "<job_radix>0</job_radix>",
        "<total_runtime>962.123456</total_runtime>" if state == "C" else "",
        "<submit_host>login01</submit_host><init_work_dir>/home/alice/gptflow</init_work_dir>",
        "<request_version>1</request_version></Job></Data>",
    ]
    return '<?xml version="1.0"?>\n' + "".join(parts) + "\n"


def status(tmp_path: Path, job: str, record: str) -> tuple[str, list[str]]:
    """status.py JOB with a `qstat` that prints `record` for `-f -x JOB` (anything else is a
    usage error): its answer, and the qstat command lines it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "record").write_text(record)
    calls = tmp_path / "calls"
    qstat = bin_dir / "qstat"
    qstat.write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> '{calls}'\n"
        f'if [ "$1 $2 $3" = "-f -x {job}" ]; then exec /bin/cat \'{tmp_path / "record"}\'; fi\n'
        'echo "usage: qstat [-f] [-x] job_identifier" >&2\nexit 2\n'
    )
    qstat.chmod(0o755)
    out = subprocess.run(
        [sys.executable, str(STATUS), job],
        env={"PATH": str(bin_dir)},  # no sacct: the record alone decides
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, calls.read_text().splitlines()


CASES = {
    "finished": (pbspro("F", 92, 0, "Job run at Tue Nov 18 at 09:12 on (x3001c0s13b0n0:ncpus=32:"
                        "ngpus=4) and finished"), torque("C", 0), "success"),
    "failed": (pbspro("F", 92, 1, "Job run at Tue Nov 18 at 09:12 on (x3001c0s13b0n0:ncpus=32:"
                      "ngpus=4) and failed"), torque("C", 1), "failed"),
    # PBS Pro: 256 + SIGTERM after the walltime; Torque: JOB_EXEC_FAIL1, the job never started
    "killed": (pbspro("F", 92, 271, "job killed: walltime 43260 exceeded limit 43200"),
               torque("C", -1), "failed"),
    "running": (pbspro("R", 42, None, "Job run at Tue Nov 18 at 09:12 on (x3001c0s13b0n0:"
                       "ncpus=32:ngpus=4)"), torque("R"), "running"),
    "exiting": (pbspro("E", 51, None, "Job run at Tue Nov 18 at 09:12 on (x3001c0s13b0n0:"
                       "ncpus=32:ngpus=4)"), torque("E"), "running"),
    "queued": (pbspro("Q", 10, None, "Not Running: Insufficient amount of resource: ngpus "
                      "(R: 4 A: 0 T: 2240)"), torque("Q"), "running"),
    "held": (pbspro("H", 20, None, "Job held by alice on Tue Nov 18 09:13:02 2025"),
             torque("H"), "running"),
}  # fmt: skip


@pytest.mark.parametrize("system", ["pbspro", "torque"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_qstat_record_maps_to_snakemakes_state(tmp_path, case, system):
    pro, xml, want = CASES[case]
    job = "4107.pbs01" if system == "pbspro" else "4107.torque01"
    answer, calls = status(tmp_path, job, pro if system == "pbspro" else xml)
    assert answer == f"{want}\n", (case, system)
    assert calls == [f"-f -x {job}"]  # one qstat, the historical (-x) full record


def test_the_records_are_what_each_system_prints():
    """The canned records hold what the parser must find and nothing it could trip on: PBS
    Pro's text has one job_state line and Exit_status only once finished; Torque's XML is one
    <Job> whose exit_status appears only when completed."""
    import xml.etree.ElementTree as ET

    for name, (pro, xml, _) in CASES.items():
        assert pro.count("job_state = ") == 1, name
        assert ("Exit_status = " in pro) == pro.__contains__("job_state = F"), name
        (job,) = ET.fromstring(xml.split("\n", 1)[1]).findall("Job")
        assert job.findtext("Job_Id") == "4107.torque01"
        assert (job.find("exit_status") is not None) == (job.findtext("job_state") == "C"), name
