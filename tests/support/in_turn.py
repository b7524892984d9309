"""Several training runs of one layout in one launch: the cost of starting Python with torch and
DeepSpeed (several seconds of CPU per rank) paid once per launch rather than once per run.

As a script, under torchrun for more than one rank (what :func:`train_in_turn` starts)::

    python tests/support/in_turn.py [--hooks FILE] RECORD RUN_DIR[@EXIT_INTERVAL] ...

Each run is a fresh start of :func:`gptflow.train.main.train`, as ``gptflow train --exit-interval N``
makes it, except that the process group is made once and kept for all of them: DeepSpeed
keeps its groups in module globals (as tests/unit/train/test_kfac_layouts.py's probe does). So the
runs of one launch share a layout -- the same tensor and pipeline parallel sizes, ZeRO stages
and precisions may differ -- and a run of another layout never finds groups made for one
before it (refused here). A resume is never one of these runs: tests resume a run's copy
(:func:`copy_run`) in a process of its own, whose only state is the checkpoint.

``--hooks FILE``: Python run once before the runs, given ``current`` (``current["record"]``
is the running run's record: what the hooks add to it lands in RECORD). Writes
``RECORD.{rank}``: {run directory's name: {"code": the exit code, ...}}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def train_in_turn(
    runs: list[tuple[Path, int | None]], ranks: int, record: Path, hooks: str = "", env=None
) -> dict[str, list[dict]]:
    """Train `runs` ((run directory, exit interval or None), in order) in one launch of
    `ranks` ranks; returns {run name: [rank 0's record, rank 1's, ...]}."""
    script = [__file__]
    if hooks:
        hooks_file = record.with_suffix(".hooks.py")
        hooks_file.write_text(hooks)
        script += ["--hooks", str(hooks_file)]
    script += [str(record), *(f"{run}@{exit_at}" if exit_at else str(run) for run, exit_at in runs)]
    cmd = [sys.executable, *script] if ranks == 1 else [
        str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", *script
    ]  # fmt: skip
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    per_rank = [json.loads(Path(f"{record}.{r}").read_text()) for r in range(ranks)]
    return {run.name: [rec[run.name] for rec in per_rank] for run, _ in runs}


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of run directory `src` at `dst` (checkpoints, metrics, logs), its run.yaml
    naming `dst`: for a test to continue or change a run that a fixture trained once."""
    shutil.copytree(src, dst, symlinks=True)
    path = dst / "run.yaml"
    text = path.read_text()
    line = f"\nrun_dir: {src}\n"
    assert text.count(line) == 1, f"{path}: no single run_dir line naming {src}"
    path.write_text(text.replace(line, f"\nrun_dir: {dst}\n"))
    return dst


def main(argv: list[str]) -> int:
    from gptflow.train import device
    from gptflow.train.main import train
    from gptflow.train.run_config import RunConfig

    current: dict = {}
    if argv[0] == "--hooks":
        hooks, argv = argv[1], argv[2:]
        exec(compile(Path(hooks).read_text(), hooks, "exec"), {"current": current})
    record, *specs = argv
    runs = []
    for spec in specs:
        path, _, exit_at = spec.partition("@")
        runs.append((Path(path), int(exit_at) if exit_at else None))
    layouts = {}
    for path, _ in runs:
        t = RunConfig.load(path / "run.yaml").train
        layouts[path.name] = (t.tensor_parallel, t.pipeline_parallel)
    if len(set(layouts.values())) > 1:
        print(f"in_turn.py: runs of one layout only (tensor, pipeline): {layouts}", file=sys.stderr)
        return 2

    def setup(env, timeout, plain=device.setup):
        """One process group (and DeepSpeed's view of it) for all the runs."""
        if "dev" not in current:
            current["dev"] = plain(env, timeout)
        return current["dev"]

    shutdown = device.Device.shutdown
    device.setup, device.Device.shutdown = setup, lambda self: None
    records = {}
    for path, exit_at in runs:
        current["record"] = {}
        code = train(path / "run.yaml", threads=1, exit_interval=exit_at)
        records[path.name] = {"code": code, **current["record"]}
    if "dev" in current:
        shutdown(current["dev"])
    with open(f"{record}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(records, f)
    return 0


if __name__ == "__main__":
    from gptflow.train import device

    sys.exit(device.leave(main(sys.argv[1:])))  # without the interpreter's teardown
