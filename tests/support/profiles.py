"""profiles/slurm as a new user edits it: the README's quick start names the lines to set (its
first YAML block under "On a Slurm cluster"); the tests fill exactly those, with the values of
the cluster they run on, into a copy of the shipped profile."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def quickstart_keys() -> dict:
    """The README's quick-start profile block, parsed: the keys a user is told to set."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## On a Slurm cluster", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "README: no yaml block in 'On a Slurm cluster'"
    return yaml.safe_load(block[1])


def leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(leaves(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def edited_slurm_profile(directory: Path, values: dict) -> Path:
    """A copy of profiles/slurm in `directory` with the quick start's lines set to `values`
    (same nesting as the README's block). `values` must set exactly the README's keys: a test
    that needs another edit fails here, which means the quick start would not be enough."""
    named, given = set(leaves(quickstart_keys())), set(leaves(values))
    assert named == given, (
        f"the README's quick start names {sorted(named - given)} more, {sorted(given - named)} "
        "fewer than this cluster needs"
    )
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    for path, value in leaves(values).items():
        node = profile
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return directory


# The test cluster of tests/slurm/start-cluster.sh: one node, 8 CPUs, 4 GPUs (gres), account
# "default", partition "debug"; two ranks of one CPU each for the tiny config (8 samples of 4)
TEST_CLUSTER = {
    "default-resources": {"slurm_account": "default", "slurm_partition": "debug"},
    "set-threads": {"train_gpt": 1},
    "set-resources": {
        "train_gpt": {
            "slurm_partition": "debug",
            "nodes": 1,
            "tasks_per_node": 2,
            "gres": "gpu:2",
            "mem_mb": 6000,  # as tests/slurm/profile: 2 processes and their snapshots
            "gpu_mem_mb": 81920,
        },
        "evaluate": {"slurm_partition": "debug"},
    },
}
