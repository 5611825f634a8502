"""FSDP2 helpers for the shared loop: sharding on CPU, and optimizer state between layouts.

`shard_on_cpu` makes an FSDP launch without a GPU really shard (accelerate alone would fall
back to DDP); `optimizer_state_by_index` / `optimizer_state_by_name` convert a full
optimizer state between `Optimizer.state_dict()`'s numbered layout (what checkpoints
store, so one loads under 1 process, DDP or FSDP alike) and torch.distributed.checkpoint's
layout keyed by parameter name (what FSDP2's full-state-dict functions take and give).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from sprout.errors import SproutError


def shard_on_cpu(acc: Accelerator) -> None:
    """Turn a CPU run launched for FSDP into FSDP2 over gloo, instead of the DDP accelerate gives it.

    accelerate 1.15 enables FSDP only for accelerator backends (MULTI_GPU, MULTI_XPU, ...); on
    CPU an FSDP launch becomes MULTI_CPU and the model is silently replicated with DDP. FSDP2
    itself runs on CPU over gloo, so this sets accelerate's distributed type to FSDP with the
    plugin the launch configured (the FSDP_* variables `accelerate launch` sets from
    fsdp_config): the sharded path (DTensor parameters, gathered checkpoints, resume) is then
    testable on CPU and on laptops. A single unlaunched process stays unsharded, as on a GPU.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if acc.distributed_type != DistributedType.MULTI_CPU:  # one unlaunched process, or already switched
        return
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* environment (version 2, see make_accelerator)
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)  # what accelerate does for FSDP on a GPU
    acc.state.fsdp_plugin = plugin
    # accelerate keeps the type in both shared states (AcceleratorState copies it to PartialState)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if acc.distributed_type != DistributedType.FSDP or not acc.is_fsdp2:
        raise SproutError("accelerate config: could not switch this CPU run to FSDP2; "
                          "launch with configs/accelerate/cpu_ddp.yaml instead")


def optimizer_state_by_index(state: dict) -> dict:
    """A full optimizer state keyed by parameter name (torch.distributed.checkpoint's layout)
    re-keyed as `Optimizer.state_dict()` keys it: parameters numbered in param_groups order."""
    index = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
    return {"state": {index[name]: s for name, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """The inverse of `optimizer_state_by_index`; `names`: parameter names in param_groups order."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def local_params(model: torch.nn.Module) -> int:
    """Parameter elements held by this process: a shard of each under FSDP2, all of them otherwise."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
