"""DLRover's Megatron-LM drop-ins (flash checkpoint) vs Megatron-LM's own legacy save and load,
side by side in one run: the time the training waits, the time until the step is on storage,
and the load after a restart.

Megatron-LM's ``megatron.training`` is not on PyPI, so its legacy (``--ckpt-format torch``) save
stands in as what it does: build the file's state (``model``, ``optimizer``,
``opt_param_scheduler``, ``rng_state``, ``args``, ``iteration``) and ``torch.save`` it to
``iter_<n>/mp_rank_00/model_optim_rng.pt``, then (on storage) fsync it; its load is
``torch.load`` of that file and ``load_state_dict``. The model is megatron-core's GPTModel on
the CPU (one rank, no parallelism), trained one step with Adam so the optimizer state exists.

    cd benchmarks && python megatron_checkpoint.py --hidden 1024 --layers 8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29571")):  # fmt: skip
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from framework_checkpoint import fsync_tree, print_table, warm_memory  # noqa: E402

ARGS = argparse.Namespace(save="", load="", consumed_train_samples=0, finetune=False)
training = types.ModuleType("megatron.training")
training.get_args = lambda: ARGS  # type: ignore[attr-defined]
sys.modules["megatron.training"] = training

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET  # noqa: E402
from dlrover.checkpoint.saver import CheckpointSaver  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint import megatron as flash  # noqa: E402


def build(hidden: int, layers: int) -> tuple[list[torch.nn.Module], torch.optim.Optimizer, Any]:
    """megatron-core's GPTModel (CPU, one rank), Adam after one step, a step LR schedule."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 64),
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=1024,
        max_sequence_length=64,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = sum(p.float().pow(2).mean() for p in model.parameters())
    loss.backward()  # type: ignore[union-attr]
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    return [model], optimizer, scheduler


def megatron_legacy_state(model: list[torch.nn.Module], optimizer: Any, scheduler: Any, it: int
                          ) -> dict[str, Any]:  # fmt: skip
    """What Megatron-LM's legacy save puts in model_optim_rng.pt."""
    return {
        "args": ARGS,
        "checkpoint_version": 3.0,
        "iteration": it,
        "model": model[0].state_dict_for_save_checkpoint(),  # type: ignore[operator]
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": [flash.rng_state()],
        "num_floating_point_operations_so_far": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm-memory-gib", type=float, default=8.0)
    args = parser.parse_args()
    if args.warm_memory_gib > 0:
        warm_memory(args.warm_memory_gib)
    dist.init_process_group("gloo")
    model, optimizer, scheduler = build(args.hidden, args.layers)
    params = sum(p.numel() for p in model[0].parameters())
    root = Path(tempfile.mkdtemp(prefix="mlm-bench-", dir=os.environ.get("BENCH_DIR")))
    saver = CheckpointSaver(str(root / "saver.sock"), shm_prefix=f"mlmbench-{os.getpid()}")
    saver.start()
    os.environ[ENV_CHECKPOINT_SOCKET] = saver.socket_path
    ARGS.save = ARGS.load = str(root / "flash")
    own = root / "own"
    rows: dict[str, list[float]] = {
        "ours: save to memory (non-persistent)": [],
        "ours: DISK save, blocked": [],
        "ours: DISK save until on storage": [],
        "Megatron-LM legacy save (torch.save)": [],
        "Megatron-LM legacy save + fsync": [],
        "ours: load (from memory)": [],
        "Megatron-LM legacy load (torch.load)": [],
    }
    try:
        flash.save_checkpoint(1, model, optimizer, scheduler, 0, {}, non_persistent_ckpt=True)
        for i in range(args.repeats):
            it = 2 * i + 2
            t = time.perf_counter()
            flash.save_checkpoint(it, model, optimizer, scheduler, 0, {}, non_persistent_ckpt=True)
            rows["ours: save to memory (non-persistent)"].append(time.perf_counter() - t)
            os.sync()  # neither side pays for the other's dirty pages
            t = time.perf_counter()
            flash.save_checkpoint(it + 1, model, optimizer, scheduler, 0, {})
            rows["ours: DISK save, blocked"].append(time.perf_counter() - t)
            assert flash.wait_latest_checkpoint(600)
            rows["ours: DISK save until on storage"].append(time.perf_counter() - t)
            os.sync()
            path = own / f"iter_{it + 1:07d}" / "mp_rank_00" / "model_optim_rng.pt"
            t = time.perf_counter()
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(megatron_legacy_state(model, optimizer, scheduler, it + 1), path)
            rows["Megatron-LM legacy save (torch.save)"].append(time.perf_counter() - t)
            fsync_tree(path)
            rows["Megatron-LM legacy save + fsync"].append(time.perf_counter() - t)
            shutil.rmtree(path.parent.parent)
            # A restart's load: ours from the agent's memory; Megatron-LM's reads its file.
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(megatron_legacy_state(model, optimizer, scheduler, it + 1), path)
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(i + 1)
            t = time.perf_counter()
            assert flash.load_checkpoint(model, optimizer, scheduler)[0] == it + 1
            rows["ours: load (from memory)"].append(time.perf_counter() - t)
            assert flash.checkpointer_for().last_load_source == "memory"
            t = time.perf_counter()
            state = torch.load(path, weights_only=False)
            model[0].load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["opt_param_scheduler"])
            rows["Megatron-LM legacy load (torch.load)"].append(time.perf_counter() - t)
            shutil.rmtree(path.parent.parent)
    finally:
        flash.checkpointer_for().close()
        saver.close(unlink=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"megatron-core GPTModel, {params / 1e6:.0f} M parameters + Adam (about "
          f"{params * 12 / 2**30:.1f} GiB of state), 1 rank, medians of {args.repeats} "
          "(min-max); saves / Megatron-LM's save, loads / its load")  # fmt: skip
    print_table(
        rows,
        "Megatron-LM",
        "Megatron-LM legacy save (torch.save)",
        "Megatron-LM legacy load (torch.load)",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
