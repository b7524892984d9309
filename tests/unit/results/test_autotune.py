"""Autotune's ranking (gptflow.results.autotune) on trials' files written here: the throughput
of the timed steps only, the order, what ran out of memory and what was refused, the page
(escaped) and best.yaml, which plans as a config file."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from gptflow.errors import GptflowError
from gptflow.results import autotune


def rec(step, ms, timed=1, tokens_per_step=1000, mfu=None):
    return {"kind": "train", "step": step, "ms_per_step": ms, "timed_steps": timed,
            "tokens_per_s": tokens_per_step / (ms / 1000) if ms else None, "mfu": mfu}  # fmt: skip


def test_the_throughput_is_the_timed_steps_tokens_over_their_time():
    records = [
        rec(1, None, 0),  # the warm-up step: no time
        rec(2, 900.0),  # compilation: left out (warmup_steps 2)
        rec(3, 100.0),
        {"kind": "eval", "step": 3, "val_loss": 5.0},
        rec(5, 200.0, timed=2),  # a record of 2 steps (log_interval 2)
    ]
    got = autotune.measure(records, warmup_steps=2)
    assert got["tokens_per_s"] == pytest.approx(3000 / 0.5)  # 3 steps of 1000 tokens in 0.5 s
    assert got["ms_per_step"] == pytest.approx(500 / 3) and got["steps"] == 3
    assert got["spread"] == pytest.approx(0.5 / 1.5) and got["mfu"] is None
    with pytest.raises(GptflowError, match=r"no timed step after the first 5 \(autotune"):
        autotune.measure(records, warmup_steps=5)


def write_trial(tmp_path, name, status, ms=None, message=""):
    d = tmp_path / name
    d.mkdir()
    trial = {"status": status} if status == "measured" else {"status": status, "message": message}
    (d / "DONE.json").write_text(json.dumps({"run": name, "trial": trial}))
    if ms is not None:
        lines = [rec(s, ms) for s in range(1, 6)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return {"done": str(d / "DONE.json"), "metrics": str(d / "metrics.jsonl")}


def candidate(name, micro, refused=""):
    return {"trial": name, "micro_batch_size": micro, "zero_stage": 1,
            "activation_checkpointing": False, "grad_accum": 1, "memory": "-",
            "refused": refused}  # fmt: skip


@pytest.fixture
def ranked(tmp_path):
    cands = [candidate("r.tune.mb1", 1), candidate("r.tune.mb2", 2), candidate("r.tune.mb3", 3,
             "not a multiple"), candidate("r.tune.mb8", 8), candidate("r.tune.mb4", 4)]  # fmt: skip
    trials = {
        "r.tune.mb1": write_trial(tmp_path, "r.tune.mb1", "measured", ms=200.0),
        "r.tune.mb2": write_trial(tmp_path, "r.tune.mb2", "measured", ms=100.0),
        "r.tune.mb4": write_trial(tmp_path, "r.tune.mb4", "measured", ms=150.0),
        "r.tune.mb8": write_trial(tmp_path, "r.tune.mb8", "out_of_memory",
                                  message="CUDA out of memory <tried 2 GiB>"),
    }  # fmt: skip
    out = {k: tmp_path / f"out.{k}" for k in ("json", "html", "yaml")}
    best = autotune.autotune_report("r", cands, trials, 2, json_out=out["json"],
                                    page_out=out["html"], best_out=out["yaml"])  # fmt: skip
    return best, out


def test_the_fastest_measured_leads_then_out_of_memory_then_refused(ranked):
    best, out = ranked
    rows = json.loads(out["json"].read_text())["candidates"]
    assert [r["trial"] for r in rows] == ["r.tune.mb2", "r.tune.mb4", "r.tune.mb1", "r.tune.mb8",
                                          "r.tune.mb3"]  # fmt: skip
    assert [r.get("rank") for r in rows] == [1, 2, 3, None, None]
    assert [r["status"] for r in rows[3:]] == ["out_of_memory", "refused"]
    assert best["trial"] == "r.tune.mb2" and best["tokens_per_s"] == pytest.approx(10_000)


def test_the_page_ranks_the_measured_and_escapes_what_a_trial_said(ranked):
    page = ranked[1]["html"].read_text()
    ranked_table = page.split("<h2>")[0]
    assert ranked_table.index("r.tune.mb2") < ranked_table.index("r.tune.mb4")
    assert "r.tune.mb8" not in ranked_table and "r.tune.mb3" not in ranked_table
    assert "CUDA out of memory &lt;tried 2 GiB&gt;" in page and "<tried" not in page
    assert "<h2>Refused by the preflight (not run)</h2>" in page


def test_best_yaml_is_a_config_file_the_run_plans_with(ranked, plan_of, tiny_config):
    text = ranked[1]["yaml"].read_text()
    assert text.startswith("# gptflow autotune of run r: the fastest of 3 measured layout(s), "
                           "10,000 tokens/s (1.50x the next, r.tune.mb4).")  # fmt: skip
    best = yaml.safe_load(text)
    assert best == {"model": {"activation_checkpointing": False},
                    "train": {"micro_batch_size": 2, "zero_stage": 1}}  # fmt: skip
    cfg = copy.deepcopy(tiny_config)
    cfg["model"].update(best["model"])
    cfg["train"].update(best["train"])
    run = plan_of(cfg).runs["tiny"]
    assert (run.train.micro_batch_size, run.train.zero_stage) == (2, 1)


def test_a_search_where_every_candidate_ran_out_of_memory_is_one_line(tmp_path):
    trials = {"r.tune.mb8": write_trial(tmp_path, "r.tune.mb8", "out_of_memory", message="x")}
    with pytest.raises(GptflowError, match="every admitted candidate ran out of memory "
                       r"\(r.tune.mb8\): add smaller autotune.micro_batch_sizes"):  # fmt: skip
        autotune.autotune_report("r", [candidate("r.tune.mb8", 8)], trials, 2,
                                 json_out=tmp_path / "a", page_out=tmp_path / "b",
                                 best_out=tmp_path / "c")  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
