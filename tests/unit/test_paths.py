"""One home per path pattern (gptflow.paths): the rules, the package and DESIGN.md's Outputs
table name the same files."""

import re
from pathlib import Path

from gptflow import paths
from gptflow.train.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]


def test_patterns_are_those_of_the_design():
    assert paths.RAW_FILE == "resources/raw/{dataset}/{file}"
    assert paths.tokenizer_json("gpt2") == "results/tokenizers/gpt2/tokenizer.json"
    assert paths.shard_prefix("gpt2", "pile", "00003") == "results/tokens/gpt2/pile/00003"
    assert paths.shard_files("x/00003") == ["x/00003.bin", "x/00003.idx", "x/00003.json"]
    assert paths.shard_manifest("x/00003") == "x/00003.json"  # what read_manifest reads
    assert paths.part_prefix("gpt2", "pile", "00003", 7) == "results/tokens/gpt2/pile/00003-0007"
    assert paths.part_prefix("gpt2", "pile", "00003", "*") == "results/tokens/gpt2/pile/00003-*"
    assert paths.merged_prefix("gpt2", "pile") == "results/tokens/gpt2/pile/merged"
    assert paths.RUN_YAML.format(run="tiny") == "results/runs/tiny/run.yaml"
    assert paths.DONE.format(run="tiny") == "results/runs/tiny/DONE.json"
    assert paths.log("train_gpt", "{run}") == "logs/train_gpt/{run}.log"
    assert paths.log("tokenize_part", "t/d/00000-0001") == "logs/tokenize_part/t/d/00000-0001.log"


def test_a_run_file_is_found_in_the_run_directory_run_yaml_records():
    """run.yaml's run_dir is where the trainer, evaluate and export look, wherever it is."""
    assert paths.in_run_dir(paths.DONE, "/scratch/r") == Path("/scratch/r/DONE.json")
    assert paths.in_run_dir(paths.RUN_DIR, "/scratch/r") == Path("/scratch/r")
    cfg = RunConfig.__new__(RunConfig)
    object.__setattr__(cfg, "run_dir", "/scratch/r")
    assert cfg.run_yaml_path == Path("/scratch/r/run.yaml")
    assert cfg.done_path == Path("/scratch/r/DONE.json")
    assert cfg.metrics_path == Path("/scratch/r/metrics.jsonl")
    assert cfg.lock_path == Path("/scratch/r/train.lock")
    assert cfg.train_log_path == Path("/scratch/r/train.log")
    assert cfg.index_cache_dir == Path("/scratch/r/data-index")
    assert cfg.checkpoint_root == Path("/scratch/r/checkpoints")
    assert cfg.tensorboard_dir == Path("/scratch/r/tensorboard")
    assert cfg.wandb_dir == Path("/scratch/r/wandb")


def test_every_run_pattern_is_inside_the_run_directory():
    run_patterns = [v for k, v in vars(paths).items() if k.isupper() and "{run}" in str(v)]
    assert len(run_patterns) >= 14
    for pattern in run_patterns:
        assert pattern == paths.RUN_DIR or pattern.startswith(paths.RUN_DIR + "/"), pattern


def test_the_rules_spell_no_output_path_of_their_own():
    """Every results/, resources/ and logs/ path in a rule file comes from gptflow.paths: no
    string literal in the rules' code starts with one (docstrings and comments may say them)."""
    spelled = []
    for smk in [*sorted((REPO / "rules").glob("*.smk")), REPO / "Snakefile"]:
        for i, line in enumerate(smk.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for literal in re.findall(r"f?\"([^\"]*)\"", code):
                if re.match(r"(results|resources|logs)/", literal):
                    spelled.append(f"{smk.name}:{i}: {literal}")
    assert spelled == []


def test_choice_pattern_matches_exactly_the_names_and_shares_their_prefixes():
    """The wildcard constraint of {run}, {dataset}, {index}: every name and nothing else (a
    prefix, an extension, a name cut in the middle), and for a study's grid of names sharing
    prefixes a pattern far shorter than the names joined (Snakemake compiles it into each
    output pattern with the wildcard: planning time per run)."""
    names = [
        f"lr{lr:g}-weight_decay{wd:g}" for lr in (1e-3, 1.41e-3, 2e-3) for wd in (0, 0.01, 0.1)
    ]
    names += ["a", "ab", "a.b", "b-c", "a(b)"]
    pattern = re.compile(rf"\A(?:{paths.choice_pattern(names)})\Z")
    assert all(pattern.match(name) for name in names)
    others = ["", "lr0.001", "lr0.001-weight_decay0.0", "lr0.001-weight_decay", "abc", "aab",
              "a.", "axb", "b", "b-", "lr0.001-weight_decay0.1x", "a(b"]  # fmt: skip
    assert not [name for name in others if pattern.match(name)]
    assert paths.choice_pattern([]) == ""
    grid = [f"lr{i / 1000:g}-weight_decay{j / 100:g}" for i in range(1, 11) for j in range(10)]
    grid_pattern = re.compile(rf"\A(?:{paths.choice_pattern(grid)})\Z")
    assert all(grid_pattern.match(name) for name in grid)
    assert len(paths.choice_pattern(grid)) < len("|".join(map(re.escape, grid))) / 3
