"""Megatron-LM's ``megatron.training`` stood in for (it is not on PyPI): a module whose
``get_args()`` returns the namespace given, installed before DLRover's Megatron drop-ins import
it; and an optimizer with the checkpoint interface of megatron.core's ``FP32Optimizer``, which
needs CUDA to be built. Shared by the Megatron-LM style test scripts and the benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from itertools import chain
from typing import Any

import torch


def stand_in_megatron_training(**arguments: Any) -> argparse.Namespace:
    """Install ``megatron.training`` with ``get_args()`` returning these arguments; returns
    them (the script sets ``save``, ``load`` and the rest on it as Megatron-LM would)."""
    args = argparse.Namespace(**arguments)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args  # type: ignore[attr-defined]
    if importlib.util.find_spec("megatron") is None:
        sys.modules["megatron"] = types.ModuleType("megatron")
    sys.modules["megatron.training"] = training
    return args


class CpuOptimizer:
    """torch's Adam with the checkpoint interface of megatron.core's ``FP32Optimizer``
    (``sharded_state_dict`` over the model's, one common step)."""

    is_stub_optimizer = False

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups  # Adam's load_state_dict replaces the list

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state["state"].pop("common_step", None)
        if step is not None:
            for param_state in state["state"].values():
                param_state["step"] = step.clone() if torch.is_tensor(step) else step
        self.optimizer.load_state_dict(state)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False, **_: Any
    ) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:  # the state's tensors to load into, as megatron's init_state_fn makes
            for p in self.params:
                if self.optimizer.state.get(p):
                    continue  # as megatron's: only a parameter without state gets one
                self.optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        assert len(steps) <= 1, steps
        common = next((s["step"] for s in state["state"].values() if "step" in s), None)
        ids = get_param_id_to_sharded_param_map(
            model_sharded_state_dict, chain.from_iterable(g["params"] for g in self.param_groups)
        )
        optim_state_to_sharding_state(state, ids, exclude_keys="step")
        if common is not None:
            state["state"]["common_step"] = common
        return state
