"""DLRover's Megatron-LM drop-ins (flash checkpoint) vs Megatron-LM's own save and load, side by
side in one run: the time the training waits, the time until the step is on storage, and the
load after a restart. ``--format torch`` (Megatron-LM's legacy files) or ``torch_dist``
(megatron.core's ``dist_checkpointing``, Megatron-LM's default).

Megatron-LM's ``megatron.training`` is not on PyPI, so its legacy (``--ckpt-format torch``) save
stands in as what it does: build the file's state (``model``, ``optimizer``,
``opt_param_scheduler``, ``rng_state``, ``args``, ``iteration``) and ``torch.save`` it to
``iter_<n>/mp_rank_00/model_optim_rng.pt``, then (on storage) fsync it; its load is
``torch.load`` of that file and ``load_state_dict``. The model is megatron-core's GPTModel on
the CPU (one rank, no parallelism), trained one step with Adam so the optimizer state exists.

With ``torch_dist`` Megatron-LM's save and load are megatron.core's own ``dist_checkpointing.save``
(synchronous, its default ``torch_dist`` strategy, which writes and fsyncs the files before it
returns) and ``dist_checkpointing.load`` of the sharded state dict the drop-ins build as
Megatron-LM's ``generate_state_dict`` does; the optimizer is Adam behind the checkpoint
interface of megatron.core's ``FP32Optimizer`` (tests/scripts/megatron_args.py), which needs
CUDA to be built. megatron.core's file writer calls ``torch.cuda.synchronize`` and
``current_device`` around its writes; with no GPU here they are made no-ops for its side.

    cd benchmarks && python megatron_checkpoint.py --hidden 1024 --layers 8 --repeats 5
    cd benchmarks && python megatron_checkpoint.py --format torch_dist --repeats 5
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
sys.path.insert(0, str(REPO / "tests" / "scripts"))

for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29571")):  # fmt: skip
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from framework_checkpoint import fsync_tree, print_table, warm_memory  # noqa: E402
from megatron_args import CpuOptimizer  # noqa: E402

ARGS = argparse.Namespace(save="", load="", consumed_train_samples=0, finetune=False)
training = types.ModuleType("megatron.training")
training.get_args = lambda: ARGS  # type: ignore[attr-defined]
sys.modules["megatron.training"] = training

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET  # noqa: E402
from dlrover.checkpoint.saver import CheckpointSaver  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint import megatron as flash  # noqa: E402


def build(hidden: int, layers: int, sharded: bool) -> tuple[list[torch.nn.Module], Any, Any]:
    """megatron-core's GPTModel (CPU, one rank), Adam after one step (``sharded``: with
    FP32Optimizer's checkpoint interface), a step LR schedule."""
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
    optimizer: Any = CpuOptimizer(model, lr=1e-4) if sharded else None
    adam = optimizer.optimizer if sharded else torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = sum(p.float().pow(2).mean() for p in model.parameters())
    loss.backward()  # type: ignore[union-attr]
    adam.step()
    scheduler = torch.optim.lr_scheduler.StepLR(adam, 10)
    return [model], optimizer or adam, scheduler


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


def megatron_legacy(rows: dict[str, list[float]], step_dir: Path, model: list[torch.nn.Module],
                    optimizer: Any, scheduler: Any, it: int, restart: int) -> None:  # fmt: skip
    """Megatron-LM's legacy save (+ fsync) and, after our load from memory, its load."""
    path = step_dir / "mp_rank_00" / "model_optim_rng.pt"
    t = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(megatron_legacy_state(model, optimizer, scheduler, it), path)
    rows["Megatron-LM legacy save (torch.save)"].append(time.perf_counter() - t)
    fsync_tree(path)
    rows["Megatron-LM legacy save + fsync"].append(time.perf_counter() - t)
    our_load(rows, model, optimizer, scheduler, it, restart)
    t = time.perf_counter()
    state = torch.load(path, weights_only=False)
    model[0].load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    rows["Megatron-LM legacy load (torch.load)"].append(time.perf_counter() - t)
    shutil.rmtree(step_dir)


def megatron_torch_dist(rows: dict[str, list[float]], step_dir: Path,
                        model: list[torch.nn.Module], optimizer: Any, scheduler: Any, it: int,
                        restart: int) -> None:  # fmt: skip
    """megatron.core's own torch_dist save and, after our load from memory, its load, of the
    state dict the drop-ins build as Megatron-LM does."""
    from megatron.core import dist_checkpointing

    def state(is_loading: bool) -> dict[str, Any]:
        sd = flash._torch_dist_state(ARGS, model, optimizer, scheduler, flash._Groups(), "",
                                     iteration=it, is_loading=is_loading)  # fmt: skip
        sd["num_floating_point_operations_so_far"] = 0
        return sd

    step_dir.mkdir(parents=True, exist_ok=True)
    synchronize, current_device = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a: None), (lambda: "cpu")  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        dist_checkpointing.save(state(False), str(step_dir))
        rows["Megatron-LM torch_dist save (dist_checkpointing)"].append(time.perf_counter() - t)
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = synchronize, current_device  # type: ignore[assignment]
    our_load(rows, model, optimizer, scheduler, it, restart)
    t = time.perf_counter()
    loaded = dist_checkpointing.load(state(True), str(step_dir))
    model[0].load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rows["Megatron-LM torch_dist load"].append(time.perf_counter() - t)
    shutil.rmtree(step_dir)


def our_load(rows: dict[str, list[float]], model: list[torch.nn.Module], optimizer: Any,
             scheduler: Any, it: int, restart: int) -> None:  # fmt: skip
    """A restart's load through the drop-in, from the agent's memory."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart + 1)
    t = time.perf_counter()
    assert flash.load_checkpoint(model, optimizer, scheduler)[0] == it
    rows["ours: load (from memory)"].append(time.perf_counter() - t)
    assert flash.checkpointer_for().last_load_source == "memory"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm-memory-gib", type=float, default=8.0)
    parser.add_argument("--format", choices=["torch", "torch_dist"], default="torch")
    args = parser.parse_args()
    if args.warm_memory_gib > 0:
        warm_memory(args.warm_memory_gib)
    dist.init_process_group("gloo")
    ARGS.ckpt_format = args.format
    model, optimizer, scheduler = build(args.hidden, args.layers, args.format == "torch_dist")
    params = sum(p.numel() for p in model[0].parameters())
    root = Path(tempfile.mkdtemp(prefix="mlm-bench-", dir=os.environ.get("BENCH_DIR")))
    saver = CheckpointSaver(str(root / "saver.sock"), shm_prefix=f"mlmbench-{os.getpid()}")
    saver.start()
    os.environ[ENV_CHECKPOINT_SOCKET] = saver.socket_path
    ARGS.save = ARGS.load = str(root / "flash")
    own = root / "own"
    dist_format = args.format == "torch_dist"
    peer_save, peer_load = (
        ("Megatron-LM torch_dist save (dist_checkpointing)", "Megatron-LM torch_dist load")
        if dist_format
        else ("Megatron-LM legacy save (torch.save)", "Megatron-LM legacy load (torch.load)")
    )
    rows: dict[str, list[float]] = {
        "ours: save to memory (non-persistent)": [],
        "ours: DISK save, blocked": [],
        "ours: DISK save until on storage": [],
        peer_save: [],
        **({} if dist_format else {"Megatron-LM legacy save + fsync": []}),
        "ours: load (from memory)": [],
        peer_load: [],
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
            if dist_format:
                megatron_torch_dist(rows, own / f"iter_{it + 1:07d}", model, optimizer,
                                    scheduler, it + 1, i)  # fmt: skip
            else:
                megatron_legacy(rows, own / f"iter_{it + 1:07d}", model, optimizer, scheduler,
                                it + 1, i)  # fmt: skip
    finally:
        flash.checkpointer_for().close()
        saver.close(unlink=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"megatron-core GPTModel, {params / 1e6:.0f} M parameters + Adam (about "
          f"{params * 12 / 2**30:.1f} GiB of state), 1 rank, medians of {args.repeats} "
          "(min-max); saves / Megatron-LM's save, loads / its load")  # fmt: skip
    print_table(rows, "Megatron-LM", peer_save, peer_load)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
