"""The evaluate rule's options and memory, from the package (gptflow.results.evaluate)."""

from gptflow.results import evaluate


def test_the_evaluate_rules_options_from_the_eval_config():
    """A prompt is one glued word (it may start with '-'); each extra prefix is NAME PREFIX
    after --extra, and its .bin and .idx are the job's inputs."""
    assert evaluate.prompt_args(["def ", "-x"]) == ["--prompt=def ", "--prompt=-x"]
    extra = {"wiki": ["t/wiki/00000", "t/wiki/00001"], "code": ["c"]}
    assert evaluate.extra_args(extra) == [
        "--extra", "wiki", "t/wiki/00000", "--extra", "wiki", "t/wiki/00001",
        "--extra", "code", "c",
    ]  # fmt: skip
    assert evaluate.extra_files(extra) == [
        "t/wiki/00000.bin", "t/wiki/00000.idx", "t/wiki/00001.bin", "t/wiki/00001.idx",
        "c.bin", "c.idx",
    ]  # fmt: skip
    assert evaluate.extra_args({}) == evaluate.extra_files({}) == evaluate.prompt_args([]) == []
