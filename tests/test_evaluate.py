"""Evaluation: pass@k over prompts by hand, exact figures from a policy whose answers are
known, prompts split over ranks, the task prompts equal to the prep's, and scripts/evaluate.py
end to end on a tiny checkpoint (1 vs 2 processes: slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from proc import free_port, run_group, run_here
from test_sft_train import base  # noqa: F401 (fixture: a tiny base checkpoint with the sp tokenizer)

import sprout.evaluation.evaluate as evaluation
from sprout.chat import render
from sprout.checkpoint import read_meta
from sprout.model.generate import Rollout
from sprout.prep.rl_prompts import PromptDataConfig, prepare
from sprout.evaluation.tasks import file_prompts, task_prompts
from sprout.evaluation.evaluate import evaluate_prompts, mean_pass_at_k, problem_scores
from sprout.evaluation.statistics import mean_interval, wilson_interval

ROOT = Path(__file__).resolve().parents[1]


def test_mean_pass_at_k_over_prompts_by_hand():
    counts = [(4, 3), (4, 0), (4, 1)]  # (n, correct) of three prompts
    assert mean_pass_at_k(counts, 1) == pytest.approx((3 / 4 + 0 + 1 / 4) / 3)
    # k=2: 1 - C(n-c, 2)/C(4, 2): C(1,2)=0 -> 1; C(4,2)/C(4,2) -> 0; C(3,2)=3 of 6 -> 1/2
    assert mean_pass_at_k(counts, 2) == pytest.approx((1 + 0 + 0.5) / 3)
    assert mean_pass_at_k(counts, 4) == pytest.approx((1 + 0 + 1) / 3)


# ---- a policy whose answers are known -----------------------------------------------------------

def R(answer) -> str:
    return f"<think>work</think><answer>{answer}</answer>"


PROMPTS = [
    {"id": "a", "prompt": [{"role": "user", "content": "What is 2 + 2?"}], "gold": "4", "level": 1},
    {"id": "b", "prompt": [{"role": "user", "content": "What is 5 + 5?"}], "gold": "10", "level": 1},
    {"id": "c", "prompt": [{"role": "user", "content": "What is 3 + 4?"}], "gold": "7", "level": 2},
]
# (text, ended with the stop token); 4 samples each
SAMPLED = [
    [(R(4), True), (R(4), True), (R(5), True), ("so <answer>4</answer>", True)],  # 3 correct, 3 formatted
    [(R(11), True), (R(9), True), (R(12), True), ("<think>still going", False)],  # 0 correct, 1 cut
    [(R(7), True), (R(6), True), (R(8), True), (R(1), True)],  # 1 correct, 4 formatted
]
GREEDY = [(R(4), True), (R(11), True), ("7 <answer>7</answer>", True)]  # right, wrong, right unformatted


class StubPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_seq_len=64)
        self.w = torch.nn.Parameter(torch.zeros(1))


def fake_generate(tok, calls):
    """generate_tokens answering each prompt from SAMPLED / GREEDY, recording its calls."""
    which = {tuple(render(p["prompt"], tok, add_generation_prompt=True)[0]): i for i, p in enumerate(PROMPTS)}

    def generate_tokens(model, ids, mask, *, max_new_tokens, num_generations=1, greedy=False, tokenizer=None,
                        generator=None, temperature=1.0, cuda_graph="auto", weight_cache=None):
        calls.append((ids.shape[0], num_generations, greedy, max_new_tokens))
        rows = []
        for r in range(ids.shape[0]):
            q = which[tuple(ids[r][mask[r] == 1].tolist())]
            for text, stopped in ([GREEDY[q]] if greedy else SAMPLED[q][:num_generations]):
                rows.append((tok.encode(text) + ([tok.eot_id] if stopped else []), stopped))
        L = max(len(t) for t, _ in rows)
        ids_out = torch.tensor([t + [0] * (L - len(t)) for t, _ in rows])
        lengths = torch.tensor([len(t) for t, _ in rows])
        eos = torch.tensor([s for _, s in rows])
        cmask = (torch.arange(L)[None] < lengths[:, None]).long()
        return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=ids_out, completion_mask=cmask,
                       logprobs=torch.zeros(len(rows), L), eos=eos, truncated=~eos, lengths=lengths)

    return generate_tokens


def sampled_tokens(tok) -> int:
    return sum(len(tok.encode(t)) + s for rows in SAMPLED for t, s in rows)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_known_answers_give_exact_figures(sp, monkeypatch, batch_size):
    calls = []
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, calls))
    ev = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(1, 2, 4), greedy=True, max_new_tokens=16,
                          batch_size=batch_size, num_samples=2)
    m = ev.metrics
    assert m["prompts"] == 3
    assert m["pass@1"] == pytest.approx(1 / 3) and m["pass@2"] == pytest.approx(0.5) and m["pass@4"] == pytest.approx(2 / 3)
    assert m["greedy/accuracy"] == pytest.approx(2 / 3) and m["greedy/format_rate"] == pytest.approx(2 / 3)
    assert m["format/rate"] == pytest.approx(10 / 12)
    assert m["completions/clipped_ratio"] == pytest.approx(1 / 12)
    assert m["completions/mean_length"] == pytest.approx(sampled_tokens(sp) / 12)
    assert ev.by_level["1"]["pass@1"] == pytest.approx((0.75 + 0) / 2) and ev.by_level["1"]["prompts"] == 2
    assert ev.by_level["1"]["greedy/accuracy"] == 0.5
    assert ev.by_level["2"]["pass@1"] == 0.25 and ev.by_level["2"]["greedy/accuracy"] == 1.0
    assert ev.flat("eval/")["eval/level_2/pass@1"] == 0.25
    assert [s["id"] for s in ev.samples] == ["a", "b"]
    a = ev.samples[0]
    assert (a["prompt"], a["gold"], a["completion"], a["answer"], a["correct"], a["correct_of_n"]) == \
        ("What is 2 + 2?", "4", R(4), "4", True, "3/4")
    assert a["greedy_correct"] and not ev.samples[1]["greedy_correct"]
    batches = -(-3 // batch_size)
    assert len(calls) == 2 * batches  # one sampled and one greedy call per batch


def test_per_problem_records_and_intervals(sp, monkeypatch):
    """One record per problem with its counts; each figure is the mean of its per-problem
    scores, and its interval: Wilson for 0/1 scores (greedy), the seeded bootstrap otherwise."""
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, []))
    ev = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(1, 2, 4), greedy=True, max_new_tokens=16)
    problems = ev.problems()
    assert problems == [  # every answer here is in a block: the flexible counts equal the strict ones
        {"id": "a", "source": None, "level": 1, "n": 4, "correct": 3, "formatted": 3, "flexible_correct": 3,
         "greedy_correct": 1, "greedy_formatted": 1, "flexible_greedy_correct": 1},
        {"id": "b", "source": None, "level": 1, "n": 4, "correct": 0, "formatted": 3, "flexible_correct": 0,
         "greedy_correct": 0, "greedy_formatted": 1, "flexible_greedy_correct": 0},
        {"id": "c", "source": None, "level": 2, "n": 4, "correct": 1, "formatted": 4, "flexible_correct": 1,
         "greedy_correct": 1, "greedy_formatted": 0, "flexible_greedy_correct": 1}]
    for figure in ("pass@1", "pass@2", "pass@4", "greedy/accuracy", "greedy/format_rate", "format/rate"):
        scores = problem_scores(problems, figure)
        assert sum(scores) / 3 == pytest.approx(ev.metrics[figure])
    assert problem_scores(problems, "completions/mean_length") is None
    assert problem_scores(problems, "pass@8") is None  # k above n
    total, by_level = ev.intervals()
    assert total["greedy/accuracy_ci"] == list(wilson_interval(2, 3))
    assert total["greedy/format_rate_ci"] == list(wilson_interval(2, 3))
    assert total["pass@1_ci"] == list(mean_interval([0.75, 0.0, 0.25]))
    assert total["pass@4_ci"] == list(wilson_interval(2, 3))  # pass@4 of 4 samples is 0 or 1 per problem
    assert total["format/rate_ci"] == list(mean_interval([0.75, 0.75, 1.0]))
    assert set(total) == {f"{f}_ci" for f in ("pass@1", "pass@2", "pass@4", "greedy/accuracy",
                                              "greedy/format_rate", "format/rate", "flexible/pass@1",
                                              "flexible/pass@2", "flexible/pass@4", "flexible/greedy/accuracy")}
    lo, hi = total["pass@1_ci"]
    assert 0.0 <= lo < ev.metrics["pass@1"] < hi <= 0.75
    assert by_level["1"]["greedy/accuracy_ci"] == list(wilson_interval(1, 2))
    assert by_level["2"]["pass@1_ci"] == [0.25, 0.25]  # one problem: every resample is it
    assert ev.intervals() == (total, by_level)  # seeded: the same intervals again

    greedy_only = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=0, greedy=True, max_new_tokens=16)
    assert greedy_only.problems()[0] == {"id": "a", "source": None, "level": 1, "n": 0, "greedy_correct": 1,
                                         "greedy_formatted": 1, "flexible_greedy_correct": 1}
    assert set(greedy_only.intervals()[0]) == {"greedy/accuracy_ci", "greedy/format_rate_ci",
                                               "flexible/greedy/accuracy_ci"}


def test_a_record_without_an_id_is_paired_by_the_preps_id(sp, monkeypatch):
    from sprout.prep.rl_prompts import prompt_key, source_prompt_id
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, []))
    records = [{k: v for k, v in p.items() if k != "id"} for p in PROMPTS]
    records[1]["source"] = "mine"
    ev = evaluate_prompts(StubPolicy(), sp, records, n=1, greedy=False, max_new_tokens=16)
    assert [p["id"] for p in ev.problems()] == [source_prompt_id("prompt", prompt_key(PROMPTS[0]["prompt"])),
                                                source_prompt_id("mine", prompt_key(PROMPTS[1]["prompt"])),
                                                source_prompt_id("prompt", prompt_key(PROMPTS[2]["prompt"]))]
    assert ev.problems()[1]["source"] == "mine"
    assert ev.intervals()[0] == {"pass@1_ci": list(wilson_interval(2, 3)),  # first samples: 4, 11, 7
                                 "format/rate_ci": list(wilson_interval(3, 3)),
                                 "flexible/pass@1_ci": list(wilson_interval(2, 3))}


def test_greedy_only_and_refusals(sp, monkeypatch):
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, []))
    ev = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=0, greedy=True, max_new_tokens=16)
    assert ev.metrics == {"prompts": 3, "greedy/accuracy": pytest.approx(2 / 3), "greedy/format_rate": pytest.approx(2 / 3),
                          "flexible/greedy/accuracy": pytest.approx(2 / 3)}
    with pytest.raises(evaluation.SproutError, match="every k must be in"):
        evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(8,), max_new_tokens=16)
    long = [{**PROMPTS[0], "id": "long", "prompt": [{"role": "user", "content": "apple " * 80}]}]
    with pytest.raises(evaluation.SproutError, match="prompt long: .* tokens leave no room"):
        evaluate_prompts(StubPolicy(), sp, long, n=1, max_new_tokens=16)


def test_prompts_split_over_two_ranks_give_the_figures_of_one(sp, monkeypatch):
    """Batch j goes to rank j mod 2; a rank without a batch in a round still makes its calls
    (one token, counted nothing); the gathered counts give the single-process figures."""
    monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, []))
    single = evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(1, 2), greedy=True, max_new_tokens=16,
                              batch_size=1, num_samples=3)
    parts, calls = {}, {0: [], 1: []}

    def run_rank(rank):
        monkeypatch.setattr(evaluation, "generate_tokens", fake_generate(sp, calls[rank]))

        def gather(out, obj):
            parts[rank] = obj
            out[:] = [parts.get(0, obj), parts.get(1, obj)]

        monkeypatch.setattr(evaluation.dist, "all_gather_object", gather)
        acc = SimpleNamespace(process_index=rank, num_processes=2)
        return evaluate_prompts(StubPolicy(), sp, PROMPTS, n=4, ks=(1, 2), greedy=True, max_new_tokens=16,
                                batch_size=1, num_samples=3, accelerator=acc)

    run_rank(1)  # batch 1, then nothing (batches 0 and 2 are rank 0's)
    ev = run_rank(0)
    assert [o.index for o in parts[0][0]] == [0, 2] and [o.index for o in parts[1][0]] == [1]
    assert len(calls[0]) == len(calls[1]) == 4
    assert calls[1][2:] == [(1, 1, True, 1), (1, 1, True, 1)]  # the padding round: one token each
    assert ev.metrics == single.metrics and ev.by_level == single.by_level and ev.samples == single.samples


# ---- the task prompts --------------------------------------------------------------------------

def test_arith_prompts_are_the_preps_test_prompts(tmp_path):
    source = {"name": "arithmetic_test", "format": "arithmetic", "count": 12, "levels": [1, 2, 3, 4],
              "split": "test", "own_split": True}
    prepare(PromptDataConfig(out=str(tmp_path), seed=0, sources=[source]), log=lambda *a: None)
    prepared = [json.loads(line) for line in (tmp_path / "prompts_test.jsonl").read_text().splitlines()]
    ours = task_prompts("arith", "test", max_examples=12, log=lambda *a: None)
    assert sorted(ours, key=lambda r: r["id"]) == sorted(prepared, key=lambda r: r["id"])
    assert {r["level"] for r in ours} == {1, 2, 3, 4}
    assert file_prompts(tmp_path / "prompts_test.jsonl", max_examples=5) == prepared[:5]


def test_gsm8k_prompts_from_a_mirror(tmp_path):
    rows = [{"question": "Tom has 1,000 apples and buys 80 more. How many?", "answer": "1000 + 80\n#### 1,080"},
            {"question": "No final answer here?", "answer": "just words"},
            {"question": "Tom has 1,000 apples and buys 80 more. How many?", "answer": "#### 1080"}]
    path = tmp_path / "sft" / "gsm8k" / "test.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    records = task_prompts("gsm8k", "test", mirror=str(tmp_path), log=lines.append)
    assert [(r["gold"], r["level"], r["source"]) for r in records] == [("1080", None, "gsm8k_test")]
    assert records[0]["prompt"] == [{"role": "user", "content": rows[0]["question"]}]
    assert lines == ["gsm8k: left out 1 record(s): duplicate", "gsm8k: left out 1 record(s): no_final_answer"]


# ---- the script --------------------------------------------------------------------------------

ARGS = ["--task", "arith", "--max-examples", "6", "--n", "2", "--k", "1,2", "--greedy", "--max-new-tokens", "6",
        "--batch-size", "2", "--samples", "3"]


def evaluate_script(*args) -> subprocess.CompletedProcess:
    return run_here([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *map(str, args)], cwd=ROOT)


def test_script_writes_the_json_and_a_table(base, tmp_path):
    out = tmp_path / "eval.json"
    r = evaluate_script(base, *ARGS, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pass@2" in r.stdout and "level 4" in r.stdout and f"wrote {out}" in r.stdout
    result = json.loads(out.read_text())
    meta = read_meta(base)
    assert result["checkpoint"] == {"path": meta["path"], "stage": "pretrain", "step": 100,
                                    "weights_sha256": meta["files"]["model.safetensors"]}
    assert {k: result["settings"][k] for k in ("n", "ks", "greedy", "seed", "max_new_tokens")} == \
        {"n": 2, "ks": [1, 2], "greedy": True, "seed": 0, "max_new_tokens": 6}
    m = result["metrics"]
    assert m["prompts"] == 6 and set(result["by_level"]) == {"1", "2", "3", "4"}
    assert all(0 <= m[k] <= 1 for k in ("pass@1", "pass@2", "greedy/accuracy", "format/rate"))
    assert 1 <= m["completions/mean_length"] <= 6
    assert [s["index"] for s in result["samples"]] == [0, 1, 2]
    # one record per problem, by the task's prompt ids; each figure with its 95 % interval
    prompts = task_prompts("arith", max_examples=6, log=lambda *a: None)
    problems = result["problems"]
    assert [p["id"] for p in problems] == [r["id"] for r in prompts]
    assert [(p["source"], p["level"], p["n"]) for p in problems] == [(r["source"], r["level"], 2) for r in prompts]
    assert sum(p["correct"] / 2 for p in problems) / 6 == pytest.approx(m["pass@1"])
    assert sum(p["greedy_correct"] for p in problems) / 6 == pytest.approx(m["greedy/accuracy"])
    assert m["greedy/accuracy_ci"] == list(wilson_interval(sum(p["greedy_correct"] for p in problems), 6))
    for figures in (m, *result["by_level"].values()):
        for name in ("pass@1", "pass@2", "greedy/accuracy", "greedy/format_rate", "format/rate"):
            lo, hi = figures[f"{name}_ci"]
            assert 0 <= lo <= figures[name] <= hi <= 1
        assert "completions/mean_length_ci" not in figures
    assert "  95 % interval" in r.stdout


def test_script_cuda_graph_option_gives_the_same_answers(base, tmp_path):
    """--cuda-graph true (the static-shape decode step; a CUDA graph only on CUDA) answers as the
    default does here (auto: the eager step on the CPU), and the JSON records it."""
    results = {}
    for value in ("auto", "true"):
        out = tmp_path / f"{value}.json"
        r = evaluate_script(base, *ARGS, "--cuda-graph", value, "--out", out)
        assert r.returncode == 0, r.stderr[-2000:]
        results[value] = json.loads(out.read_text())
    assert results["true"]["settings"]["cuda_graph"] == "true"
    assert results["true"]["problems"] == results["auto"]["problems"]
    assert results["true"]["samples"] == results["auto"]["samples"]


def test_script_refuses_a_k_above_n_with_one_line(base):
    r = evaluate_script(base, "--task", "arith", "--n", "4", "--k", "8")
    assert r.returncode == 2 and r.stderr.strip() == "error: --k 8: every k must be between 1 and --n (4)"


def test_preferences_refuse_the_generation_options_in_one_line(tmp_path):
    r = evaluate_script(tmp_path, "--preferences", "p.jsonl", "--n", "16", "--greedy", "--temperature", "0.7",
                        "--max-examples", "9", "--samples", "0", "--split", "test", "--k", "1", "--seed", "0")
    assert r.returncode == 2 and r.stderr.strip() == ("error: --n, --k, --greedy, --max-examples, --temperature, "
                                                      "--seed, --samples, --split: only with --task or --prompts, "
                                                      "not --preferences")
    r = evaluate_script(tmp_path, "--prompts", "p.jsonl", "--split", "dev")
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: --split goes with --task (a --prompts file is its own split)"


@pytest.mark.slow
def test_two_processes_give_the_figures_of_one(base, tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    r = evaluate_script(base, *ARGS, "--out", one)
    assert r.returncode == 0, r.stderr[-2000:]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "evaluate.py"), str(base), *ARGS, "--out", str(two)]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["settings"]["processes"] == 2
    assert (a["metrics"], a["by_level"], a["samples"], a["problems"]) == \
        (b["metrics"], b["by_level"], b["samples"], b["problems"])


@pytest.mark.slow
def test_evaluation_of_an_fsdp_model_equals_one_process(sp, tmp_path):
    """evaluate_prompts on the FSDP2 module itself (every forward a collective), rank 1 with a
    padding round: the figures of the unsharded model in one process."""
    from fsdp_eval_worker import PROMPTS, SETTINGS, model

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_fsdp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "fsdp_eval_worker.py"), sp.spec, str(tmp_path)]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "fsdp.json").read_text())
    alone = evaluate_prompts(model(), sp, PROMPTS, **SETTINGS)
    assert got == json.loads(json.dumps({"metrics": alone.metrics, "by_level": alone.by_level,
                                         "samples": alone.samples}))
