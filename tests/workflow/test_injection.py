"""Hostile values in every place a config or a corpus can put text on a rule's command line:
each shell metacharacter, with a canary file that a shell interpreting it would create.

The data stage really runs (Snakemake -> bash -> `gptflow train-tokenizer` / `tokenize`) with
the hostile values, and must arrive at the package verbatim: the trained tokenizer holds
each hostile special token, and the documents are read under the hostile JSON key from
files under a hostile directory and file names. Rules that cannot run here cheaply (evaluate,
the downloads) are checked in the dry run's printed commands: each hostile word appears
single-quoted, as one argument.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from .conftest import REPO

# What a shell would run from unquoted text: `touch CANARY` reached by each metacharacter.
TEMPLATES = [
    "$(touch {c})",
    "`touch {c}`",
    "x; touch {c}",
    "x | touch {c}",
    "x && touch {c}",
    "x || touch {c} ||",
    "x\ntouch {c}",
    "x > {c}",
    "' ; touch {c} ; '",
    '" ; touch {c} ; "',
    "${{IFS}}$(touch {c})",
    "-x $(touch {c})",
]


def payloads(place: str) -> list[str]:
    """Each template once, its canary named after the place (created in the job's working
    directory, the workflow's, if a shell ever ran it)."""
    return [t.format(c=f"CANARY-{place}-{i}") for i, t in enumerate(TEMPLATES)]


def hostile_config(tmp_path: Path) -> dict:
    corpus = tmp_path / "corpus; touch CANARY-root"
    corpus.mkdir(parents=True)
    key = "text$(touch CANARY-json-key)"
    sources = Path(REPO / "src" / "gptflow").glob("*.py")
    docs = [{key: p.read_text()} for p in sorted(sources)]
    for i, name in enumerate(payloads("file")[:4]):
        part = docs[i::4]
        (corpus / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))
    # a control character is refused in any name-like value (the schema's rule, checked
    # below); free text (prompts) takes every payload
    specials = [v for v in payloads("special") if "\n" not in v]
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    cfg["datasets"] = {
        "hostile": {
            "type": "local",
            "root": str(corpus),
            "include": ["*.jsonl"],
            "format": "jsonl",
            "json_key": key,
        }
    }
    cfg["tokenizer"]["eod_token"] = specials[0]
    cfg["tokenizer"]["special_tokens"] = specials
    cfg["tokenizer"]["train"]["datasets"] = ["hostile"]
    cfg["data"]["blend"] = [{"dataset": "hostile", "weight": 1.0}]
    cfg["eval"] = {"prompts": payloads("prompt")}
    return cfg


def test_hostile_values_reach_the_package_verbatim_and_run_nothing(
    tmp_path, snakemake, write_config
):
    cfg = hostile_config(tmp_path)
    config = write_config(tmp_path / "hostile.yaml", cfg)
    wd = tmp_path / "wd"

    plan = snakemake(wd, config, "-n", "-p")
    assert plan.returncode == 0, plan.out
    # after the launcher's words: none here (`{params.launcher:q}` of [] is an empty string)
    start = re.search(r"Shell command: +(gptflow evaluate )", plan.out).start(1)
    evaluate = plan.out[start : plan.out.index("\n\n", start)]
    for prompt in cfg["eval"]["prompts"]:  # one argument each, inside single quotes
        assert f" {shlex.quote(f'--prompt={prompt}')} " in evaluate
    words = shlex.split(evaluate)
    assert [w for w in words if w.startswith("--prompt=")] == [
        f"--prompt={p}" for p in cfg["eval"]["prompts"]
    ]

    newline = {**cfg, "tokenizer": {**cfg["tokenizer"], "special_tokens": payloads("special")}}
    refused = snakemake(tmp_path / "wd2", write_config(tmp_path / "nl.yaml", newline), "-n")
    assert refused.returncode == 1
    assert (
        "'tokenizer.special_tokens[6]' is 'x\\ntouch CANARY-special-6', which holds a "
        "control character" in refused.out
    )
    assert not (tmp_path / "wd2" / "results").exists()

    run = snakemake(wd, config, "data")
    assert sorted(tmp_path.rglob("CANARY-*")) == []
    assert run.returncode == 0, run.out

    tokenizer = json.loads(next(wd.glob("results/tokenizers/*/tokenizer.json")).read_text())
    added = {t["content"] for t in tokenizer["added_tokens"]}
    assert set(cfg["tokenizer"]["special_tokens"]) <= added
    manifests = [json.loads(p.read_text()) for p in wd.glob("results/tokens/*/hostile/*.json")]
    assert len(manifests) == 4
    assert all(m["documents"] > 0 for m in manifests), manifests
