"""The reward-model stage: its loss and metrics on hand-set scores, learning a seeded synthetic
preference, scores independent of padding side, a checkpoint that loads as a scorer, exact
resume, 1 vs 2 processes (slow), and bad preference files refused through the script; the
log-probability score (reward.score logprob) by hand, learning against a length bias, its
checkpoint an LM, exact resume, 1 vs 2 processes, and the options it refuses."""

import json
import math
import re
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from preference_train_fixtures import (MARK, base, cli_flags, grouped_held_out_pairs, marked_pairs,  # noqa: F401 (base)
                                       resume_folder, tiny_cfg, write_pairs)
from proc import free_port, run_group, run_here

from data_loader.preference_batches import PreferenceLoader
from sprout.checkpoint import read_meta
from sprout.formats.checkpoint_meta import reward_score_of
from sprout.model.heads import RewardModel
from sprout.model.load import load_model
from sprout.engine.metrics import read_metrics
from sprout.errors import SproutError
from sprout.formats.preference_pairs import read_preferences, write_preferences
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.stages.preference_stage import pair_groups
from sprout.chat import render
from sprout.model.transformer import Transformer
from sprout.stages.reward import (
    RewardConfig,
    RewardLossConfig,
    RewardStage,
    pair_scores,
    population_std,
    run_reward,
    score_sequences,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("prefs"), source=lambda i: ("even", "odd")[i % 2])


@pytest.fixture(scope="module")
def run_a(data, base, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_a")
    return out, run_reward(tiny_cfg(RewardConfig, data, base, out))


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


# ---- the loss of one micro-batch, on scores set by hand ----------------------------------------------
class FixedScores(torch.nn.Module):
    """A 'reward model' whose score for row i is values[i] at every position."""

    def __init__(self, values):
        super().__init__()
        self.values = torch.tensor(values)

    def forward(self, input_ids, *, segment_ids=None, position_ids=None):
        return self.values[:, None].expand(input_ids.shape).clone()


def test_loss_and_metrics_hand_computed(data, sp):
    loader = PreferenceLoader(data, sp, batch_size=3, seq_len=64, shuffle=False)
    batch = loader.collate([0, 1, 2], real=[True, True, False])  # pair 2 pads an eval batch: counts nothing
    batch["margin"] = torch.tensor([0.5, 0.0, 0.0])
    model = FixedScores([1.0, 0.5, 7.0, 0.0, 1.5, -3.0])  # chosen 1.0, 0.5, 7; rejected 0.0, 1.5, -3
    stage = RewardStage(None, loader, loader, 1, RewardLossConfig(center_rewards_coefficient=0.1))
    loss, n, m = stage.loss(model, batch)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = -math.log(sig(1.0 - 0.0 - 0.5)) + 0.1 * 1.0 ** 2 - math.log(sig(0.5 - 1.5)) + 0.1 * 2.0 ** 2
    assert loss.item() == pytest.approx(want, rel=1e-6) and n.item() == 2
    assert stage.count_targets(batch).item() == 2
    value = {k: s.item() / c.item() for k, (s, c) in m.items()}
    assert value["accuracy"] == 0.5 and value["margin"] == pytest.approx((1.0 - 1.0) / 2)
    assert value["rewards/chosen"] == pytest.approx(0.75) and value["rewards/rejected"] == pytest.approx(0.75)
    assert value["rewards/chosen_sq"] == pytest.approx((1.0 + 0.25) / 2)  # std = sqrt(0.625 - 0.75²) = 0.25
    stage.loss_cfg = RewardLossConfig(use_margin=False)
    loss2, _, _ = stage.loss(model, batch)
    assert loss2.item() == pytest.approx(-math.log(sig(1.0)) - math.log(sig(-1.0)), rel=1e-6)
    assert stage.num_tokens(batch) == int(batch["attention_mask"].sum())  # both sides, no padding



class TableScores(torch.nn.Module):
    """A 'reward model' whose score for a row is table[the row's ids] at every position, plus a
    parameter (at 0) for the optimizer to hold."""

    def __init__(self, table: dict):
        super().__init__()
        self.table, self.w = table, torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, *, segment_ids=None, position_ids=None):
        values = torch.tensor([self.table[tuple(row.tolist())] for row in input_ids])
        return values[:, None].expand(input_ids.shape) + self.w


def test_reward_std_is_over_the_global_batch_by_hand(data, sp):
    """Two micro-batches of 2 pairs in one step: chosen scores 1, 3 | 0, 4 (mean 2, mean square
    6.5: std sqrt(2.5) = 1.581, where the mean of the micro-batch stds would be 1.5), rejected
    0, 0 | 2, -2 (std sqrt(2))."""
    assert population_std(2.0, 6.5) == pytest.approx(math.sqrt(2.5))
    assert population_std(1.0, 1.0 - 1e-12) == 0.0  # rounding below zero
    loader = PreferenceLoader(data, sp, batch_size=4, seq_len=64, shuffle=False)
    batches = [loader.collate([0, 1]), loader.collate([2, 3])]
    scores = [[1.0, 3.0, 0.0, 0.0], [0.0, 4.0, 2.0, -2.0]]  # per micro-batch: chosen, chosen, rejected, rejected
    table = {tuple(row.tolist()): v for b, vals in zip(batches, scores) for row, v in zip(b["input_ids"], vals)}
    model = TableScores(table)
    cfg = TrainConfig(max_steps=1, progress=False, peak_tflops=-1)
    trainer = Trainer(make_accelerator(cfg), model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lambda step, peak: peak, cfg)
    stage = RewardStage(trainer.accelerator, loader, loader, 2, RewardLossConfig())
    m = trainer.step(batches, stage)
    assert m["targets"] == 4 and m["rewards/chosen"] == pytest.approx(2.0)
    assert m["rewards/chosen_std"] == pytest.approx(math.sqrt(2.5), rel=1e-6)
    assert m["rewards/rejected_std"] == pytest.approx(math.sqrt(2.0), rel=1e-6)


def test_held_out_accuracy_per_source_and_per_rejected_kind_by_hand(data, sp, tmp_path):
    """Four held-out pairs, scores set by hand: near misses ranked right once in two, the broken
    format once in one, a pair without a kind right; each group's accuracy over its own pairs."""
    path = grouped_held_out_pairs(data, tmp_path)
    loader = PreferenceLoader(path, sp, batch_size=4, seq_len=64, shuffle=False)
    batch = loader.collate([0, 1, 2, 3])
    chosen, rejected = [1.0, 0.0, 2.0, 1.0], [0.0, 1.0, -1.0, 0.0]  # right, wrong, right, right
    table = {tuple(row.tolist()): v for row, v in zip(batch["input_ids"], chosen + rejected)}
    stage = RewardStage(make_accelerator(TrainConfig(progress=False)), loader, loader, 1, RewardLossConfig(),
                        pair_groups(path, loader))
    got = stage.evaluate(TableScores(table))
    assert got["val_accuracy"] == 0.75 and got["val_pairs"] == 4
    assert got["val_accuracy/arith"] == pytest.approx(2 / 3) and got["val_pairs/arith"] == 3
    assert got["val_accuracy/chat"] == 1.0 and got["val_pairs/chat"] == 1
    assert got["val_accuracy/rejected_near_miss"] == 0.5 and got["val_pairs/rejected_near_miss"] == 2
    assert got["val_accuracy/rejected_broken_format"] == 1.0 and got["val_pairs/rejected_broken_format"] == 1
    assert not [k for k in got if k.startswith("val_accuracy/rejected_") and "miss" not in k and "format" not in k]
    assert {k for k in got if k.startswith("val_accuracy/")} == {  # no group for the pair without a kind
        "val_accuracy/arith", "val_accuracy/chat", "val_accuracy/rejected_near_miss", "val_accuracy/rejected_broken_format"}
    clash = tmp_path / "clash" / "preferences_dev.jsonl"  # a source named like a kind's group
    clash.parent.mkdir()
    clash.write_text(path.read_text().replace('"source": "chat"', '"source": "rejected_near_miss"'))
    with pytest.raises(SproutError, match=rf"^{clash}: source 'rejected_near_miss' has the name of a rejected_kind"):
        pair_groups(clash, PreferenceLoader(clash, sp, batch_size=4, seq_len=64, shuffle=False))


# ---- the stage end to end (in-process, tiny) -------------------------------------------------------------
def test_reward_model_learns_the_preference(run_a, base):
    out, result = run_a
    first, last = result["first_eval"], result["last_eval"]
    assert first["val_accuracy"] < 0.8  # the fixture's answers have equal lengths: no free signal
    assert last["val_accuracy"] >= 0.9 and last["val_margin"] > first["val_margin"] + 0.3
    assert {"val_accuracy/even", "val_accuracy/odd", "val_rewards/chosen_std", "val_loss"} <= set(last)
    assert last["val_accuracy/even"] >= 0.8 and last["val_accuracy/odd"] >= 0.8
    assert last["val_pairs"] == last["val_pairs/even"] + last["val_pairs/odd"] > 0  # each figure's denominator
    rec = train_records(out)
    assert sorted(rec) == list(range(1, 13))
    assert {"accuracy", "margin", "rewards/chosen", "rewards/rejected", "rewards/chosen_sq",
            "rewards/rejected_sq", "rewards/chosen_std", "rewards/rejected_std", "targets"} <= set(rec[1])
    assert rec[1]["rewards/chosen_std"] == pytest.approx(
        math.sqrt(rec[1]["rewards/chosen_sq"] - rec[1]["rewards/chosen"] ** 2), rel=1e-6, abs=1e-9)
    assert rec[1]["targets"] == 16  # pairs of the global batch
    meta = read_meta(out / "checkpoints")
    assert meta["architecture"] == "reward" and meta["stage"] == "reward" and meta["init"]["path"] == str(base)
    assert reward_score_of(meta) == {"kind": "head"} == meta["reward_score"]
    model, _ = load_model(out)
    assert isinstance(model, RewardModel)


# ---- score logprob: β × the LM's summed log-probability of the response ---------------------------------------
def test_a_logprob_score_is_beta_times_the_responses_logprob_by_hand(data, sp, base):
    """Each side's score is β × Σ log p(token | everything before it) over the tokens after the
    rendered prompt (the answer and its end-of-turn), computed here row by row, unpadded; and
    the pair loss is −log σ(r_c − r_r) of those scores."""
    lm, _ = load_model(base)
    loader = PreferenceLoader(data, sp, batch_size=3, seq_len=64, shuffle=False)
    batch = loader.collate([0, 1, 2])
    cfg = RewardLossConfig(score="logprob", beta=0.5, use_margin=False)
    with torch.no_grad():
        scores = pair_scores(lm, batch, cfg)
        per_pair, rc, rr = RewardStage(None, loader, loader, 1, cfg)._pair_loss(lm, batch)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    want = []
    for row in range(6):
        rec = records[int(batch["pair_index"][row % 3])]
        prompt = render(rec["prompt"], sp, add_generation_prompt=True)[0]
        ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
        assert ids[:len(prompt)] == prompt and len(ids) > len(prompt)
        with torch.no_grad():
            logp = lm(torch.tensor([ids]))[0].log_softmax(-1)
        want.append(0.5 * sum(float(logp[t - 1, ids[t]]) for t in range(len(prompt), len(ids))))
    assert scores.tolist() == pytest.approx(want, abs=1e-4)
    assert torch.equal(rc, scores[:3]) and torch.equal(rr, scores[3:])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert per_pair.tolist() == pytest.approx([-math.log(sig(want[i] - want[3 + i])) for i in range(3)], rel=1e-5)


@pytest.fixture(scope="module")
def run_logprob(base, tmp_path_factory):
    """The fixture's pairs the other way round: the answer without MARK is chosen. MARK takes
    fewer tokens than most words, so at step 0 the summed log-probability favours the rejected
    side; the run has to learn the preference against that."""
    folder = tmp_path_factory.mktemp("prefs_swapped")
    data = write_pairs(folder, source=lambda i: ("even", "odd")[i % 2])
    for path in (data, data.with_name("preferences_dev.jsonl")):
        write_preferences(path, [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in read_preferences(path)])
    out = tmp_path_factory.mktemp("rm_logprob")
    return out, run_reward(tiny_cfg(RewardConfig, data, base, out, score="logprob", beta=0.5)), data


def test_a_logprob_reward_model_learns_the_preference_and_saves_an_lm(run_logprob, base):
    out, result, _ = run_logprob
    first, last = result["first_eval"], result["last_eval"]
    print(f"logprob reward model: held-out accuracy {first['val_accuracy']:.3f} -> {last['val_accuracy']:.3f}, "
          f"margin {first['val_margin']:.3f} -> {last['val_margin']:.3f}")
    assert first["val_accuracy"] < 0.5 and last["val_accuracy"] >= 0.9
    assert last["val_margin"] > first["val_margin"] + 0.3
    assert first["val_rewards/chosen"] < 0 and last["val_rewards/rejected"] < 0  # β × log-probs
    assert train_records(out)[1]["targets"] == 16
    meta = read_meta(out / "checkpoints")
    assert meta["architecture"] == "lm" and meta["stage"] == "reward"
    assert reward_score_of(meta) == {"kind": "logprob", "beta": 0.5} == meta["reward_score"]
    model, _ = load_model(out)
    assert type(model) is Transformer  # a causal LM: it samples, chats and exports as one
    assert reward_score_of(read_meta(base)) is None  # an SFT checkpoint is no reward model


def test_reward_score_of_refuses_a_logprob_record_without_a_finite_positive_beta():
    meta = {"architecture": "lm", "path": "runs/rm/checkpoints/step_00000001"}
    for beta in (0, -0.1, float("inf"), True, "0.1", None):
        with pytest.raises(SproutError, match=r"^runs/rm/checkpoints/step_00000001/meta\.json: reward_score has kind "
                                              r"logprob and beta .*; expected a finite number above 0$"):
            reward_score_of({**meta, "reward_score": {"kind": "logprob", "beta": beta}})
    assert reward_score_of({**meta, "reward_score": {"kind": "logprob", "beta": 2}}) == {"kind": "logprob", "beta": 2.0}
    assert reward_score_of({**meta, "reward_score": {"kind": "other"}}) is None
    assert reward_score_of({**meta, "architecture": "reward"}) == {"kind": "head"}


def test_a_resumed_logprob_run_matches_an_uninterrupted_one_bit_for_bit(run_logprob, base, tmp_path):
    out_a, _, data = run_logprob
    out_b = resume_folder(out_a, 6, tmp_path / "rm_b")
    run_reward(tiny_cfg(RewardConfig, data, base, out_b, score="logprob", beta=0.5), resume="latest")
    a, b = train_records(out_a), train_records(out_b)
    assert sorted(b) == list(range(7, 13))
    assert [(b[s]["loss"], b[s]["accuracy"]) for s in b] == [(a[s]["loss"], a[s]["accuracy"]) for s in b]


@pytest.mark.parametrize("values, pattern", [
    ({"score": "logprob", "center_rewards_coefficient": 0.01},
     r"center_rewards_coefficient: got 0.01; expected 0 with score logprob \(a log-probability score is at most 0"),
    ({"beta": 0.2}, r"beta: got 0.2; expected 0.1 with score head \(beta scales a logprob score"),
])
def test_option_combinations_that_cannot_train_are_refused(values, pattern, data, base, tmp_path):
    with pytest.raises(SproutError, match=pattern):
        run_reward(tiny_cfg(RewardConfig, data, base, tmp_path / "out", **values))
    assert not (tmp_path / "out").exists()
    cmd = [sys.executable, str(ROOT / "scripts" / "train_reward.py"), *cli_flags(data, base, tmp_path / "cli"),
           *(f"--reward.{k}={v}" for k, v in values.items())]
    got = run_here(cmd, cwd=ROOT)
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert re.search(pattern, got.stderr) and "--reward." in got.stderr


def test_scores_do_not_depend_on_the_padding_side(run_a, sp):
    model, _ = load_model(run_a[0])
    seqs = [sp.encode(f"hello {MARK} river"), sp.encode("a much longer line of several words here"), sp.encode("x")]
    width = max(map(len, seqs))
    right = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    left = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask_r = right.new_tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    mask_l = right.new_tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    with torch.no_grad():
        r, l_ = score_sequences(model, right, mask_r), score_sequences(model, left, mask_l)
        alone = torch.stack([score_sequences(model, torch.tensor([s]), torch.ones(1, len(s)))[0] for s in seqs])
    assert torch.allclose(r, l_, atol=1e-5) and torch.allclose(r, alone, atol=1e-5)
    assert r.std() > 0  # different sequences, different scores


def test_resume_matches_an_uninterrupted_run_bit_for_bit(run_a, data, base, tmp_path):
    out_a, _ = run_a
    out_b = resume_folder(out_a, 6, tmp_path / "rm_b")
    run_reward(tiny_cfg(RewardConfig, data, base, out_b), resume="latest")
    a, b = train_records(out_a), train_records(out_b)
    assert sorted(b) == list(range(7, 13))
    assert [(b[s]["loss"], b[s]["accuracy"]) for s in b] == [(a[s]["loss"], a[s]["accuracy"]) for s in b]


# ---- bad inputs through the script: one line naming file and line, exit 2 ------------------------------------
def good(i):
    return marked_pairs(4, 7)[i]


def bad_lines(case):
    """(lines of the file, pattern the error must match)."""
    ok = [json.dumps(good(i)) for i in range(3)]
    if case == "malformed":
        return ok[:1] + ['{"id": "x", "source": '] + ok[1:], r":2: invalid JSON"
    if case == "missing":
        return ok[:2] + [json.dumps({k: v for k, v in good(3).items() if k != "rejected"})], r":3: missing key\(s\) rejected"
    if case == "roles":
        return [json.dumps({**good(3), "chosen": [{"role": "user", "content": "hi"}]})] + ok, \
            r":1: 'chosen' must be exactly one assistant message"
    if case == "empty":
        return ok + [json.dumps({**good(3), "rejected": [{"role": "assistant", "content": "  "}]})], r":4: 'rejected' is empty"
    raise ValueError(case)


@pytest.mark.parametrize("case", ["malformed", "missing", "roles", "empty"])
def test_bad_preference_file_is_one_line(case, base, data, tmp_path):
    lines, pattern = bad_lines(case)
    bad = tmp_path / "preferences.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    shutil.copy(data.with_name("preferences_dev.jsonl"), tmp_path / "preferences_dev.jsonl")
    cmd = [sys.executable, str(ROOT / "scripts" / "train_reward.py"), *cli_flags(bad, base, tmp_path / "out")]
    proc = run_here(cmd, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {bad}") and proc.stderr.count("\n") == 1, proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_file_edited_after_prep_is_refused_unless_data_verify_sizes(base, tmp_path, capsys):
    """Prep writes the files and their sha256 into manifest.json; one changed answer afterwards
    is refused at start with one line (data.verify full), and let through by data.verify sizes,
    which checks only that both files are listed."""
    from sprout.formats.verify_inputs import verify_jsonl_data
    from sprout.prep.preference_data import PreferenceDataConfig as PrepConfig
    from sprout.prep.preference_data import prepare

    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in marked_pairs(60, 3)))
    out = tmp_path / "prefs"
    prepare(PrepConfig(out=str(out), test_fraction=0.2, dev_fraction=0.2,
                       sources=[{"name": "marked", "format": "jsonl", "path": str(raw)}]), log=lambda *_: None)
    data = out / "preferences.jsonl"
    check = verify_jsonl_data(data, out / "preferences_dev.jsonl")
    assert check.files == 2 and check.hashed and not check.notes
    assert check.report("preference files").startswith("data: verified 2 preference files")

    data.write_text(data.read_text().replace(MARK, "zebra", 1))  # still a valid file
    proc = run_here([sys.executable, str(ROOT / "scripts" / "train_reward.py"),
                     *cli_flags(data, base, tmp_path / "out")], cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == f"error: {data}: sha256 does not match {out / 'manifest.json'} " \
                          f"(edited, or from another prep run)\n"
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    capsys.readouterr()
    run_reward(tiny_cfg(RewardConfig, data, base, tmp_path / "sizes", verify="sizes", global_pairs=4,
                        micro_pairs=4, max_steps=1, eval_every=0))
    assert "data: checked 2 preference files" in capsys.readouterr().out

def test_pairs_over_the_context_are_counted_or_refused(base, data, tmp_path):
    long = {**good(0), "id": "long", "chosen": [{"role": "assistant", "content": " ".join(["river"] * 80)}]}
    mixed = tmp_path / "preferences.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [good(0), long, good(1)]))
    shutil.copy(data.with_name("preferences_dev.jsonl"), tmp_path / "preferences_dev.jsonl")
    flags = cli_flags(mixed, base, tmp_path / "out", global_pairs=2, micro_pairs=1, max_steps=1, eval_every=0)
    proc = run_here([sys.executable, str(ROOT / "scripts" / "train_reward.py"), *flags], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{mixed}: 2 of 3 pairs fit 64 tokens (1 dropped as too long" in proc.stdout
    only_long = tmp_path / "long" / "preferences.jsonl"
    only_long.parent.mkdir()
    only_long.write_text(json.dumps(long) + "\n")
    shutil.copy(data.with_name("preferences_dev.jsonl"), only_long.with_name("preferences_dev.jsonl"))
    proc = run_here([sys.executable, str(ROOT / "scripts" / "train_reward.py"),
                     *cli_flags(only_long, base, tmp_path / "out2")], cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {only_long}: no pair fits seq_len 64 (1 read, 1 too long)")


# ---- multi-process --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("score", ["head", "logprob"])
def test_two_gloo_processes_match_one(score, run_a, run_logprob, data, base, tmp_path):
    # 1 process × 2 micro-batches of 8 pairs
    out_a, data, flags = (run_a[0], data, []) if score == "head" else \
        (run_logprob[0], run_logprob[2], ["--reward.score", "logprob", "--reward.beta", "0.5"])
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_reward.py"), *cli_flags(data, base, out), *flags]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) × 1 micro-steps" in proc.stdout
    a, b = train_records(out_a), train_records(out)
    assert sorted(a) == sorted(b)
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    print(f"reward model, 1 vs 2 processes: max |loss diff| over {len(a)} steps = {diff:.3g}")
    assert diff < 1e-5
    assert all(b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-4) for s in a)
    va = [r["val_accuracy"] for r in read_metrics(out_a / "metrics.jsonl") if "val_accuracy" in r]
    vb = [r["val_accuracy"] for r in read_metrics(out / "metrics.jsonl") if "val_accuracy" in r]
    assert va == vb
