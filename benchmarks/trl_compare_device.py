"""Where and in what precision benchmarks/trl_compare.py runs both sides, and how far apart the
first-batch checks may be in it.

`Precision(device, dtype)` is the one recipe of every row, the same on both sides:
- fp32: fp32 weights and arithmetic;
- bf16: fp32 master weights under bf16 autocast, what TRL users run by default (TRL's
  `bf16=True` with a model loaded in fp32; sprout's `train.mixed_precision: bf16`): sprout's
  loop through its Accelerator's autocast, TRL's trainer through its own, and every check and
  the generation row inside `torch.autocast` on both sides.
Every tensor a row builds for its checks goes through `Precision.to`; on CUDA every timestamp
follows `torch.cuda.synchronize()` (`Precision.clock`), so a step's time holds its kernels.

A check passes when its largest |difference| is at most `Precision.tolerance(row, what)`:
- fp32: 1e-4 for every check: the two implementations differ only in the order of fp32
  operations (unit roundoff 6e-8); measured: docs/results/2026-12-02-trl-compare-cpu.md.
- bf16: every matmul's output is rounded to bf16's 8 significant bits (unit roundoff
  u = 2^-8 ~ 3.9e-3) at different points on the two sides, so the two differ by about as much
  as bf16 moves either side from its own fp32 result. The tolerances (`BF16`; DPO's summed
  log-probs `BF16_SUMMED`) are about three times the differences measured on SmolLM2-135M
  under CPU autocast (docs/results/2026-12-06-trl-compare-bf16-cpu.md). Two losses do not
  depend on the rounding at the first batch and keep a tight one (`BF16_EXACT`): GRPO's (its ratio is
  exactly 1 when the old log-probs are the current ones) and DPO's at the initial weights
  (log 2 when the policy is its reference). A wrong mask, target shift or normaliser moves
  these by far more: a token more or less in a summed log-prob moves it by that token's whole
  log-prob, several units.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")
FP32 = 1e-4  # every check
BF16 = {"loss": 0.05, "adapted loss": 0.05, "logps": 1.0, "adapted logps": 1.0, "logits": 3.0}
BF16_SUMMED = {"logps": 1.5, "adapted logps": 1.5}  # DPO's: summed over each completion's tokens
BF16_EXACT = 2e-3  # GRPO's loss, and DPO's at the initial weights: rounding-free at the first batch


@dataclass(frozen=True)
class Precision:
    """The device ("cpu" or "cuda") and dtype ("fp32" or "bf16") of both sides (see the module doc)."""
    device: str = "cpu"
    dtype: str = "fp32"

    @classmethod
    def of(cls, device: str, dtype: str | None) -> "Precision":
        """--device and --dtype (None: bf16 on CUDA, fp32 on the CPU); SystemExit in one line
        when CUDA is asked for and not there."""
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("error: --device cuda: torch finds no CUDA device here (torch.cuda.is_available() "
                             "is False); run on a GPU machine or with --device cpu")
        return cls(device, dtype or ("bf16" if device == "cuda" else "fp32"))

    @property
    def mixed_precision(self) -> str:
        """accelerate's and sprout's `mixed_precision` for this dtype."""
        return "bf16" if self.dtype == "bf16" else "no"

    def autocast(self):
        """The forward's context on both sides outside the training loops: bf16 autocast, or nothing."""
        if self.dtype == "fp32":
            return nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16)

    def to(self, x):
        """`x` (a tensor, or a dict or list of them and other values) on this device."""
        if torch.is_tensor(x):
            return x.to(self.device)
        if isinstance(x, dict):
            return {k: self.to(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self.to(v) for v in x)
        return x

    def clock(self) -> float:
        """time.perf_counter() once the device has finished the work queued so far."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def accelerator(self):
        """sprout's loop's Accelerator: this device (the CPU even where CUDA is present) and mixed precision."""
        from accelerate import Accelerator

        return Accelerator(mixed_precision=self.mixed_precision, cpu=self.device == "cpu")

    @staticmethod
    def reset_accelerate() -> None:
        """Forget the mixed precision an earlier run in this process gave accelerate's
        process-wide state (which both sides' Accelerators share), so this run can set its own."""
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()

    def trl_options(self) -> dict:
        """A TRL *Config's device and precision options: TRL's bf16 (autocast over fp32 weights) or fp32."""
        return {"use_cpu": self.device == "cpu", "bf16": self.dtype == "bf16", "fp16": False}

    def describe(self) -> str:
        if self.dtype == "fp32":
            return f"fp32 on {self.device_name()}"
        return f"bf16 autocast over fp32 weights on {self.device_name()} (TRL: bf16=True; sprout: mixed_precision bf16)"

    def device_name(self) -> str:
        return torch.cuda.get_device_name(0) if self.device == "cuda" else "CPU"

    def tolerance(self, row: str, what: str) -> float:
        """How far apart check `what` of row `row` (its name) may be (see the module doc)."""
        if self.dtype == "fp32":
            return FP32
        kind = row.split()[0]  # GRPO, DPO, SFT or generate
        if what == "loss" and kind in ("GRPO", "DPO"):
            return BF16_EXACT
        if kind == "DPO" and what in BF16_SUMMED:
            return BF16_SUMMED[what]
        return BF16[what]

    def failures(self, row) -> list[str]:
        """The checks of `row` (a trl_compare_rows.Row) beyond their tolerance, as "what |diff| > tol"."""
        return [f"{what} {diff:.1e} > {self.tolerance(row.name, what):g}" for what, diff in row.check.items()
                if not diff <= self.tolerance(row.name, what)]
