"""`make test-changed`'s selection (tests/support/changed.py): the tests naming what changed."""

from tests.support.changed import select


def test_a_package_module_selects_the_tests_naming_it_and_its_direct_importers():
    chosen = select(["src/gptflow/train/kfac.py"])
    # test_kfac imports it; test_kfac_layouts only in its probe script's string
    assert {"tests/unit/train/test_kfac.py", "tests/unit/train/test_kfac_layouts.py"} <= set(chosen)
    assert "tests/workflow/test_pipeline.py" not in chosen  # the whole suite is make test
    by_importer = select(["src/gptflow/train/async_save.py"])  # gptflow.train.checkpoint imports it
    assert "tests/unit/train/test_checkpoint.py" in by_importer


def test_tests_rules_profiles_and_examples_select_their_own():
    assert select(["tests/unit/test_paths.py"]) == ["tests/unit/test_paths.py"]
    grouped = "tests/unit/data/quality/test_quality_filters.py"  # tests/unit/ grouped as src/
    assert select([grouped]) == [grouped]
    assert grouped in select(["src/gptflow/data/quality/words.py"])  # signals.py imports it
    assert "tests/unit/train/test_engine.py" in select(["tests/support/hardware.py"])
    assert "tests/workflow/test_pipeline.py" in select(["rules/evaluate.smk"])
    assert "tests/workflow/test_pbs.py" in select(["profiles/pbs/status.py"])
    assert "tests/workflow/test_examples.py" in select(["config/examples/layouts/pythia-14m.yaml"])
    assert select(["docs/" + "unread.txt"]) == []  # (split: this file would name it)
