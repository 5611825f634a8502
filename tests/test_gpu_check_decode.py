"""benchmarks/gpu_check.py's `decode` stage (benchmarks/gpu_check_decode.py) on the CPU: its
comparison passes for the static step and fails, by shape name, for a step that lets later slots
count, or for two calls on a shared set of fused weights unlike a fresh build's; the stage runs
the script with its CPU flags and records its figures, and a failed comparison fails the stage by
name. The CUDA graph itself runs only on a GPU."""

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_decode  # noqa: E402
from sprout.model.decode import DecodeWeightsCache  # noqa: E402
from sprout.model.static_decode import StaticDecoder  # noqa: E402
from test_gpu_check import in_this_process  # noqa: E402

CPU = torch.device("cpu")


class UnmaskedDecoder(StaticDecoder):
    """A static step that forgets to mask the slots past the new token, whose stale values then count."""

    def prefill(self, ids, mask, repeats=1):
        for t in self.k + self.v:
            t.fill_(3.0)  # stale values, as a reused buffer holds; the prefill overwrites slots 0..P-1
        return super().prefill(ids, mask, repeats)

    def run(self):
        x, (cos, sin) = self.model.embed_tokens(self.tokens), self.model.rotary(self.positions)
        for block, weights, k, v in zip(self.weights.blocks, self.weights.layers, self.k, self.v):
            x = block.step(x, weights, cos, sin, k, v, self.padding_bias[:, None, None], self.weights.kind, self.slot)
        self.positions.add_(1)
        self.slot.add_(1)
        return self.weights.logits(self.weights.norm(x))


def test_the_comparison_passes_for_the_static_step(tmp_path):
    out = tmp_path / "decode.json"
    results = gpu_check_decode.run(CPU, out, prompts=3, longest=12, G=2, steps=6, shapes={"tiny": gpu_check_decode.TINY})
    assert results["failed"] == {} and json.loads(out.read_text()) == results
    tiny = results["tiny"]
    assert tiny["rows"] == 6 and tiny["clear_argmax_flips"] == 0 and tiny["max_rel_diff"] <= 1e-5
    assert tiny["fp32"]["greedy_equal"] and tiny["fp32"]["token_agreement"] == 1.0 and "bf16" not in tiny
    assert tiny["fp32"]["shared_weights_equal"]


def test_a_step_that_sees_later_slots_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_decode, "StaticDecoder", UnmaskedDecoder)
    results = gpu_check_decode.run(CPU, tmp_path / "decode.json", prompts=3, longest=12, G=2, steps=6,
                                   shapes={"tiny": gpu_check_decode.TINY})
    assert "tiny" not in results and results["failed"]["tiny"].startswith("tiny: graph logits differ from eager")


class StaleSet(DecodeWeightsCache):
    """A shared set of fused weights that no longer matches the model (every parameter negated)."""

    def get(self, model, *args):
        if not hasattr(self, "stale"):
            self.stale = copy.deepcopy(model)
            with torch.no_grad():
                for p in self.stale.parameters():
                    p.neg_()
        return super().get(self.stale, *args)


def test_a_shared_set_unlike_a_fresh_build_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_decode, "DecodeWeightsCache", StaleSet)
    results = gpu_check_decode.run(CPU, tmp_path / "decode.json", prompts=3, longest=12, G=2, steps=6,
                                   shapes={"tiny": gpu_check_decode.TINY})
    assert "tiny" not in results
    assert results["failed"]["tiny"].startswith("tiny: fp32 greedy tokens on a shared set of fused weights differ")


def test_the_stage_runs_the_script_and_records_its_figures(tmp_path, monkeypatch):
    deadline = time.monotonic() + 300
    monkeypatch.setattr(gpu_check.Check, "execute", lambda check, cmd, log: in_this_process(check, cmd, log, deadline))
    check = gpu_check.Check(tmp_path, dict(os.environ), {}, ["decode"])
    gpu_check.decode(check, gpu=False)
    assert check.failed == {}
    figures = check.results["decode"]
    assert figures["graph"] is False and figures["tiny"]["steps"] == 16 and figures["tiny"]["fp32"]["greedy_equal"]
    assert figures["device"] == "cpu" and "generation_tokens_per_s" in figures
    # a comparison that fails makes the stage fail by name
    monkeypatch.setattr(gpu_check.Check, "execute", lambda check, cmd, log: (log.write_text("decode: tiny: ..."), 1)[1])
    check = gpu_check.Check(tmp_path, dict(os.environ), {}, ["decode"])
    gpu_check.decode(check, gpu=False)
    assert check.failed["decode"].startswith("decode: exit status 1") and "decode" not in check.results
    assert gpu_check.with_needs(["decode"]) == ["decode"]
