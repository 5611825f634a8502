"""What a run tells its user: log lines in a log file (loss, lr, grad norm, tok/s, MFU, elapsed,
ETA), saved checkpoints and the report's path printed, the matmul peak recorded per segment
(a resume measures again), report.md's run facts, inputs and samples, the two-panel plot, and
the warmup warning."""

import re
import shlex
import sys

import pytest
import torch
from test_sft_train import base, run_a, sft_file  # noqa: F401 (fixtures)
from test_train import tiny_cfg, write_data

from sprout.atomic import sha256_file
from sprout.checkpoint import read_meta
from sprout.engine.metrics import (duration, log_line, loss_figure, measure_matmul_flops, plot_loss_curve,
                                  read_metrics, truncate_metrics)
from sprout.stages.pretrain import run_pretrain
from sprout.engine.report import code, git_commit, provenance_section, run_section, samples_section, start_record, text
from sprout.engine.schedule import warmup_warning
from sprout.stages.configs import SAMPLE_PROMPTS
from sprout.stages.sft import SFTStage


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


# ---- pure helpers, hand-computed -----------------------------------------------------------------
def test_log_line_and_duration_hand_computed():
    record = {"step": 20, "loss": 3.14159, "lr": 2.5e-4, "grad_norm": 0.71234, "tokens_per_s": 12345.6,
              "mfu": 0.1234, "elapsed_s": 65.4}
    assert log_line(record, 100, 261.6) == ("step 20/100 | loss 3.1416 | lr 2.50e-04 | grad norm 0.712 | "
                                            "12,346 tok/s | MFU 12.3% | elapsed 0:01:05 | ETA 0:04:22")
    del record["mfu"]
    assert "MFU" not in log_line(record, 100, None) and log_line(record, 100, None).endswith("ETA ?")
    assert duration(3725.2) == "1:02:05" and duration(-3) == "0:00:00"


def test_warmup_longer_than_the_run_is_one_warning_line():
    line = warmup_warning(10, 4)
    assert line.startswith("warning: optim.warmup_steps 10 >= train.max_steps 4") and "\n" not in line
    assert warmup_warning(4, 4) is not None and warmup_warning(3, 4) is None and warmup_warning(0, 4) is None


def test_matmul_peak_is_a_median_of_probes_on_its_own_generator():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    peak = measure_matmul_flops(64, probes=3, seconds=0.01)
    assert peak > 0 and torch.equal(torch.get_rng_state(), before)  # training RNG untouched


def test_truncate_drops_the_start_of_the_segment_being_replaced(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"event": "start", "step": 0}, {"step": 4, "loss": 1.0}, {"event": "start", "step": 4},
            {"step": 6, "loss": 0.5}, {"event": "end", "step": 6}]
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    truncate_metrics(path, 4)
    assert read_metrics(path) == rows[:2]


def test_git_commit_outside_a_checkout_is_unknown(tmp_path):
    assert git_commit(tmp_path) == "unknown"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", git_commit())


# ---- a pretraining run in a log file, then resumed ----------------------------------------------
@pytest.fixture(scope="module")
def logged_run(toy_data, tmp_path_factory):
    """4 steps with the bar asked for (train.progress) but stderr not a terminal, a warmup longer
    than the run, checkpoints at 2 and 4; then resumed from step 4 to step 6. Returns the run
    folder and what each part printed."""
    out = tmp_path_factory.mktemp("logged")
    printed = []
    with pytest.MonkeyPatch.context() as mp:
        import io
        import sys

        for max_steps, resume in ((4, None), (6, "latest")):
            buf = io.StringIO()
            mp.setattr(sys, "stdout", buf)
            mp.setattr(sys, "stderr", buf)
            run_pretrain(tiny_cfg(toy_data, out, max_steps=max_steps, log_every=2, eval_every=0, ckpt_every=2,
                                  warmup_steps=8, progress=True), resume=resume)
            printed.append(buf.getvalue())
    return out, printed


def test_a_log_file_gets_plain_lines_with_every_figure(logged_run):
    out, (first, _) = logged_run
    assert "\r" not in first  # no progress bar redrawn into a log file
    lines = [line for line in first.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    pattern = (r"step 4/4 \| loss \d+\.\d{4} \| lr \d\.\d\de-\d\d \| grad norm \d+\.\d{3} \| [\d,]+ tok/s \| "
               r"MFU \d+\.\d% \| elapsed \d:\d\d:\d\d \| ETA 0:00:00")
    assert re.fullmatch(pattern, lines[1]), lines[1]


def test_saves_report_and_warmup_warning_are_printed(logged_run):
    out, (first, second) = logged_run
    for step in (2, 4):
        assert f"saved checkpoint {out / 'checkpoints' / f'step_{step:08d}'} (step {step})" in first
    assert f"report: {out / 'report.md'}" in first and f"loss curve: {out / 'loss.png'}" in first
    assert "warning: optim.warmup_steps 8 >= train.max_steps 4" in first
    assert "warning: optim.warmup_steps 8 >= train.max_steps 6" in second


def test_each_segment_records_its_own_peak(logged_run):
    out, _ = logged_run
    starts = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start"]
    assert [s["step"] for s in starts] == [0, 4]  # the resume measured again
    assert all(s["peak_source"] == "measured" and s["peak_tflops"] > 0 for s in starts)
    assert all(s["world_size"] == 1 and s["precision"] == "no" and s["hardware"]["cpu"] for s in starts)
    report = (out / "report.md").read_text()
    for i, s in enumerate(starts, 1):
        assert f"segment {i} (from step {s['step']:,}): MFU median" in report
        assert f"{s['peak_tflops']:.3g} TFLOP/s per process (measured at this start)" in report


def test_report_states_command_commit_hardware_and_resumes(logged_run):
    out, _ = logged_run
    report = (out / "report.md").read_text()
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start")
    assert f"- command: `{start['command']}`" in report and f"- git commit: `{start['git_commit']}`" in report
    assert f"- hardware: {start['hardware']['cpu']} ({start['hardware']['cpu_count']} cores); no GPU" in report
    assert "- world size 1; precision no" in report and "wall-clock time 0:00:" in report
    assert "over 2 segments" in report and "| 2 (resume) | 4 |" in report


def test_the_recorded_command_pastes_back_into_a_shell(monkeypatch):
    """The report's command is shell-quoted: split as a shell would, it is the argv the run had."""
    argv = ["scripts/train_sft.py", "--sample_prompts", '["What is 3 + 4?"]', "--train.mixed_precision", "no",
            "--out", "runs/a b"]
    monkeypatch.setattr(sys, "argv", argv)
    record = start_record(0, peak_flops=1e12, peak_source="config", device=torch.device("cpu"), world_size=1,
                          precision="no")
    assert shlex.split(record["command"])[1:] == argv


def test_a_command_with_a_pipe_or_a_backtick_stays_one_code_span_and_one_table_cell():
    """The run section's markdown: a `|` in a command (a prompt, a shell pipe) does not split its
    table row, a backtick does not end its code span, a line break does not end its line."""
    command = shlex.join(["python", "scripts/train_sft.py", "--sample_prompts", '["Is 3 | 4 `odd`?"]'])
    seg = {"step": 0, "time": "2026-12-04T00:00:00", "command": command, "git_commit": "abc", "peak_tflops": -1,
           "records": [{"step": 1, "elapsed_s": 2.0}]}
    lines = run_section([seg])
    assert f"- command: ``{command}``" in lines
    header, row = next(l for l in lines if l.startswith("| segment")), next(l for l in lines if l.startswith("| 1 "))
    cells = re.split(r"(?<!\\)\|", row)[1:-1]  # GitHub's tables split a row at each unescaped |
    assert len(cells) == header.count("|") - 1 == 6
    assert cells[-1] == " ``" + command.replace("|", "\\|") + "`` "
    assert code("`a`") == "`` `a` ``" and code("a|b") == "`a|b`" and code("a|b", cell=True) == "`a\\|b`"
    assert code("'a\nb'") == code("'a\r\nb'") == "`'a\\nb'`"  # a prompt's line break keeps the line whole


def test_a_prompt_or_an_answer_shows_its_characters_as_they_are():
    """A samples section: a `*`, `_`, `<b>` or `[x](y)` in a prompt or an answer, a leading `#`,
    `-` or `12.` on an answer's line, are backslash-escaped (CommonMark drops a backslash before
    ASCII punctuation), so the rendered text is the text itself, not emphasis, html or a list."""
    prompt, answer = "Is 2*3 = 4*5? <b>no</b>", "# 6\n- not 20\n12. right_ [x](y)"
    md = "\n".join(samples_section([{"event": "samples", "step": 3,
                                     "samples": [{"prompt": prompt, "answer": answer}]}]))
    assert "**Is 2\\*3 = 4\\*5? \\<b\\>no\\</b\\>**" in md
    assert "> \\# 6\n> \\- not 20\n> 12\\. right\\_ \\[x\\](y)" in md
    for t in (prompt, answer, "a \\ b ` c | d ~~e~~ &copy;"):
        assert re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text(t)) == t  # each escape drops back to the character
    assert text("What is 3 + 4?") == "What is 3 + 4?"
    # an indented line (code, in an answer) would be a code block, which shows escapes as typed;
    # a lone \r is a line break the markdown's own lines must show
    assert text("a\n\n    return a*b\n\tc") == "a\n\n" + "&nbsp;" * 4 + "return a\\*b\n" + "&nbsp;" * 4 + "c"
    assert text("a\r# b\r\nc") == "a\n\\# b\nc"
    md = "\n".join(samples_section([{"event": "samples", "step": 3, "samples": [{"prompt": " two\n\nlines ",
                                                                               "answer": "x"}]}]))
    assert "**two lines**" in md  # the bold prompt is one line, or its ** would show
    assert text(" a\n\n*b*\t", one_line=True) == "a \\*b\\*"


def test_configured_peak_is_recorded_as_config_and_an_mfu_above_100_percent_is_explained(toy_data, tmp_path, capsys):
    run_pretrain(tiny_cfg(toy_data, tmp_path, max_steps=2, eval_every=0, peak_tflops=2e-9))
    records = read_metrics(tmp_path / "metrics.jsonl")
    start = records[0]
    assert (start["event"], start["peak_source"], start["peak_tflops"]) == ("start", "config", 2e-9)
    assert "2e-09 TFLOP/s per process (train.peak_tflops)" in (tmp_path / "report.md").read_text()
    mfus = [r["mfu"] for r in records if "mfu" in r]
    assert mfus and all(m > 1 for m in mfus)  # a peak far below what a step reaches
    said = capsys.readouterr().out
    assert said.count("is above 100 %: the peak it is measured against, 2e-09 TFLOP/s per process "
                      "(train.peak_tflops), is below what training reached") == 1  # once per run
    assert "an MFU above 100 % means the peak it is measured against is below" in (tmp_path / "report.md").read_text()


# ---- SFT: inputs with hashes, samples, the plot ---------------------------------------------------
def test_sft_report_names_init_and_data_with_hashes(run_a, base, sft_file):
    out, _ = run_a
    report = (out / "report.md").read_text()
    weights = read_meta(base)["files"]["model.safetensors"]
    assert f"- init checkpoint: `{base}` (pretrain step 100); weights sha256 `{weights}`" in report
    meta = read_meta(out / "checkpoints")
    meta["init"]["path"] = str(out / "moved_away")  # the base gone: its sha256 comes from the record
    assert f"weights sha256 `{weights}`" in "\n".join(provenance_section(meta))
    assert f"- train data: `{sft_file}`; sha256 `{sha256_file(sft_file)}`" in report
    val = sft_file.with_name("sft_val.h5")
    assert f"- val data: `{val}`; sha256 `{sha256_file(val)}`" in report


def test_sft_samples_are_generated_and_reported(run_a):
    out, _ = run_a
    rec = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "samples")
    assert rec["step"] == 16 and [s["prompt"] for s in rec["samples"]] == list(SAMPLE_PROMPTS)
    report = (out / "report.md").read_text()
    assert "## Samples" in report
    for s in rec["samples"]:
        assert f"**{text(s['prompt'], one_line=True)}**" in report and isinstance(s["answer"], str)


def test_plot_has_a_second_panel_with_lr_and_grad_norm(run_a):
    out, _ = run_a
    records = read_metrics(out / "metrics.jsonl")
    fig = loss_figure(records, loss_label=SFTStage.loss_label, title="my run")
    loss_ax, lr_ax = fig.axes[0], fig.axes[1]  # the two panels (twin axes follow them)
    assert loss_ax.get_title() == "my run" and loss_ax.get_ylabel().startswith("masked loss")
    assert lr_ax.get_ylabel() == "learning rate"
    train = [r for r in records if "loss" in r]
    assert list(lr_ax.lines[0].get_ydata()) == [r["lr"] for r in train]
    labels = {ax.get_ylabel() for ax in fig.axes}
    assert "gradient norm (before clipping)" in labels and "val_accuracy" in labels
    assert (out / "loss.png").stat().st_size > 10_000


def test_plot_of_a_single_record_draws_points_on_integer_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "val_loss": 6.1}\n{"step": 1, "loss": 6.0, "lr": 0.001, "grad_norm": 1.5}\n'
                       '{"step": 1, "val_loss": 5.9}\n')
    assert plot_loss_curve(metrics, tmp_path / "loss.png") == tmp_path / "loss.png"
    fig = loss_figure(read_metrics(metrics))
    fig.canvas.draw()
    drawn = [line for ax in fig.axes for line in ax.lines]
    assert len(drawn) == 4 and all(line.get_marker() not in (None, "None", "") for line in drawn)
    steps = fig.axes[1].get_xticks()
    assert len(steps) > 1 and all(float(s).is_integer() for s in steps)
