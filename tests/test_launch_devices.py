"""Which device each rank's target and drafter land on, under every launcher, decided by Lightning, not the environment.

A launcher tells each process who it is through environment variables: torchrun sets RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT and TORCHELASTIC_RUN_ID; `srun` sets SLURM_PROCID,
SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID, SLURM_JOB_NAME ... and no LOCAL_RANK. Lightning reads them through its
cluster environments (`TorchElasticEnvironment`, `SLURMEnvironment`, `LightningEnvironment`) and gives each
rank its root device, `parallel_devices[local_rank]`: the drafter lands there (the strategy moves the module),
and `DrafterSystem` loads the target there (`target_placement`).

This machine has no GPU, so the tests build the Trainer on the CPU with each launcher's variables and then
give the strategy the eight `torch.device("cuda", i)` of a node (building such an object needs no CUDA): the
decision is what is checked. Reading LOCAL_RANK (the old placement) puts every srun rank on cuda:0.

The second half moves targets: `ImageTarget.to(device)` must move every tensor the target holds, which
"meta" stands in for a GPU to check on a CPU.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from conftest import build_tiny_toy_target
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import DeepSpeedStrategy

from data.drafter_data import DrafterDataModule
from models import random_weights
from models.registry import shared_target, target_device
from models.target import ImageTarget
from models.transformers_decoder import placement, process_device
from training.system import DrafterSystem

GPUS_PER_NODE = 8
NODE_GPUS = [torch.device("cuda", index) for index in range(GPUS_PER_NODE)]
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")
LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")  # fmt: skip


def clear_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every launcher variable this process inherited, so each test sets exactly its launcher's."""
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)


def torchrun(monkeypatch: pytest.MonkeyPatch, node: int, local_rank: int) -> None:
    """The variables `torchrun --nnodes 2 --nproc-per-node 8` gives local rank `local_rank` of node `node`."""
    clear_launcher(monkeypatch)
    values = {"RANK": node * GPUS_PER_NODE + local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": 2 * GPUS_PER_NODE,
              "LOCAL_WORLD_SIZE": GPUS_PER_NODE, "GROUP_RANK": node, "MASTER_ADDR": "node1", "MASTER_PORT": 29500,
              "TORCHELASTIC_RUN_ID": "drafters"}  # fmt: skip
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def srun(monkeypatch: pytest.MonkeyPatch, node: int, local_rank: int) -> None:
    """The variables `srun --nodes 2 --ntasks-per-node 8` gives task `local_rank` of node `node`: no LOCAL_RANK."""
    clear_launcher(monkeypatch)
    values = {"SLURM_PROCID": node * GPUS_PER_NODE + local_rank, "SLURM_LOCALID": local_rank,
              "SLURM_NTASKS": 2 * GPUS_PER_NODE, "SLURM_NTASKS_PER_NODE": GPUS_PER_NODE, "SLURM_NODEID": node,
              "SLURM_NNODES": 2, "SLURM_JOB_NUM_NODES": 2, "SLURM_JOB_NAME": "drafter", "SLURM_JOB_ID": 4242,
              "SLURM_NODELIST": "node[1-2]"}  # fmt: skip
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def trainer_on_a_gpu_node(strategy: object) -> L.Trainer:
    """A two-node Trainer built on the CPU, then given a node's eight GPUs as its parallel devices."""
    trainer = L.Trainer(accelerator="cpu", devices=GPUS_PER_NODE, num_nodes=2, strategy=strategy,  # type: ignore[arg-type]
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.strategy.parallel_devices = list(NODE_GPUS)  # type: ignore[attr-defined]
    return trainer


class Placed(Exception):
    """Raised by the stand-in random-weight builder with the device it was asked to build on."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(str(device))
        self.device = device


@pytest.fixture(autouse=True)
def _restore_process_rank():
    """Building a Trainer under a simulated launch sets the process-wide rank Lightning's rank-zero guards read
    (`rank_zero_only.rank`, rank 11 on node 1): restored after each test, or later tests' loggers write nothing."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pytorch_rank_zero_only

    guards = (fabric_rank_zero_only, pytorch_rank_zero_only)
    saved = [getattr(guard, "rank", None) for guard in guards]
    yield
    for guard, rank in zip(guards, saved, strict=True):
        if rank is None:
            if hasattr(guard, "rank"):
                delattr(guard, "rank")
        else:
            guard.rank = rank


@pytest.fixture
def built_devices(monkeypatch):
    """Pretend CUDA is there (as on the cluster) and record where the Janus builder is asked to build, not building."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def record(size, device, dtype, seed):
        raise Placed(torch.device(device))

    monkeypatch.setitem(random_weights.RANDOM_BUILDERS, "janus-pro-7b", record)
    shared_target.cache_clear()  # type: ignore[attr-defined]
    yield
    shared_target.cache_clear()  # type: ignore[attr-defined]


def loaded_device(trainer: L.Trainer) -> torch.device:
    """The device `DrafterSystem.setup` loads its (random-weight Janus) target on under `trainer`."""
    system = DrafterSystem(target="janus-pro-7b", target_options={"random_weights": "tiny"}, preset="tiny")
    system.trainer = trainer
    with pytest.raises(Placed) as placed:
        system.setup("fit")
    assert system.target_placement() == placed.value.device
    return placed.value.device


LAUNCHES = [
    ("torchrun+ddp", torchrun, "ddp", TorchElasticEnvironment),
    ("srun+ddp", srun, "ddp", SLURMEnvironment),
    ("srun+deepspeed", srun, "deepspeed", SLURMEnvironment),
]


@pytest.mark.parametrize("launch,launcher,strategy,environment", LAUNCHES, ids=[case[0] for case in LAUNCHES])
@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_each_rank_puts_target_and_drafter_on_its_own_gpu(
    monkeypatch, built_devices, launch, launcher, strategy, environment, local_rank
):
    launcher(monkeypatch, node=1, local_rank=local_rank)
    trainer = trainer_on_a_gpu_node(DeepSpeedStrategy(stage=2) if strategy == "deepspeed" else strategy)
    assert isinstance(trainer.strategy.cluster_environment, environment)  # type: ignore[attr-defined]
    assert trainer.strategy.local_rank == local_rank
    assert trainer.global_rank == GPUS_PER_NODE + local_rank
    # the drafter: the strategy moves the LightningModule to its root device
    assert trainer.strategy.root_device == torch.device("cuda", local_rank)
    # the target: loaded straight onto the same device, whatever LOCAL_RANK says (srun sets none)
    assert loaded_device(trainer) == torch.device("cuda", local_rank)


def test_srun_rank_ignores_a_stray_local_rank(monkeypatch, built_devices):
    """A LOCAL_RANK left over in the environment (a wrapper script, a nested launch) must not move srun's rank 5."""
    srun(monkeypatch, node=0, local_rank=5)
    monkeypatch.setenv("LOCAL_RANK", "0")
    trainer = trainer_on_a_gpu_node("ddp")
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)  # type: ignore[attr-defined]
    assert loaded_device(trainer) == torch.device("cuda", 5)


def test_single_process_keeps_the_target_on_the_trainer_device(monkeypatch, built_devices):
    clear_launcher(monkeypatch)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert isinstance(trainer._accelerator_connector.cluster_environment, LightningEnvironment)
    # CUDA "available" (patched) and no device asked: the trainer's CPU wins, not an implicit cuda:0
    assert loaded_device(trainer) == torch.device("cpu")


def test_data_module_asks_for_the_same_device_as_the_system(monkeypatch):
    """DrafterDataModule and DrafterSystem share one target instance only if they ask for the same device."""
    srun(monkeypatch, node=0, local_rank=6)
    trainer = trainer_on_a_gpu_node("ddp")
    system = DrafterSystem(target="janus-pro-7b", target_options={"random_weights": "tiny"}, preset="tiny")
    system.trainer = trainer
    data = DrafterDataModule(train_dir="unused", target="janus-pro-7b", target_options={"random_weights": "tiny"})
    data.trainer = trainer
    assert data.target_placement() == system.target_placement() == torch.device("cuda", 6)


def test_placement_reads_no_launcher_variable(monkeypatch):
    """A loader without a device builds on the CPU even with CUDA present and LOCAL_RANK set."""
    torchrun(monkeypatch, node=0, local_rank=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert placement(None, None) == (torch.device("cpu"), torch.float32)
    assert placement("cuda:2", None) == (torch.device("cuda", 2), torch.bfloat16)
    assert placement(None, "float16") == (torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("launcher,expected", [(torchrun, 5), (srun, 5)])
def test_scripts_outside_lightning_take_the_launchers_local_rank(monkeypatch, launcher, expected):
    """`process_device()` (extraction, evaluation, benchmarks): torchrun's LOCAL_RANK, else srun's SLURM_LOCALID."""
    launcher(monkeypatch, node=1, local_rank=expected)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert process_device() == torch.device("cuda", expected)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_device() == torch.device("cpu")


def test_explicit_target_device_wins_where_it_can_work():
    root = torch.device("cuda", 3)
    assert target_device({}, root) == root
    assert target_device({"device": "cuda"}, root) == root  # "the GPU": this rank's
    assert target_device({"device": "cuda:3"}, root) == root
    assert target_device({"device": "cpu"}, "cpu") == torch.device("cpu")
    assert target_device({"device": "cuda:1"}, None) == torch.device("cuda", 1)  # no trainer: the options decide
    assert target_device({}, None) is None
    for contradiction, trainer in (("cuda:0", root), ("cpu", root), ("cuda", "cpu")):
        with pytest.raises(ValueError, match=r"target_options.device=.*contradicts this process's trainer device"):
            target_device({"device": contradiction}, trainer)


def test_setup_refuses_a_target_device_that_contradicts_the_trainer(monkeypatch, built_devices):
    srun(monkeypatch, node=0, local_rank=2)
    trainer = trainer_on_a_gpu_node("ddp")
    system = DrafterSystem(target="janus-pro-7b", target_options={"random_weights": "tiny", "device": "cuda:0"},
                           preset="tiny")  # fmt: skip
    system.trainer = trainer
    with pytest.raises(ValueError, match=r"'cuda:0' contradicts this process's trainer device cuda:2"):
        system.setup("fit")


# ----------------------------------------------------------------------------- moving a target


def held_tensors(target: ImageTarget) -> dict[str, torch.Tensor]:
    """Every tensor the target holds: its modules' parameters and buffers and its plain tensor attributes."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in vars(target).items():
        if isinstance(value, torch.nn.Module):
            # every name of a shared (tied) tensor: moving to "meta" unties them, moving to a GPU keeps them tied
            tensors.update({f"{name}.{key}": tensor for key, tensor in value.named_parameters(remove_duplicate=False)})
            tensors.update({f"{name}.{key}": tensor for key, tensor in value.named_buffers(remove_duplicate=False)})
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
    return tensors


def assert_moves_everything(target: ImageTarget, device: str) -> None:
    before = {name: tensor.dtype for name, tensor in held_tensors(target).items()}
    assert before, "the target holds no tensors"
    assert target.to(device) is target
    after = held_tensors(target)
    assert after.keys() == before.keys()
    stayed = [name for name, tensor in after.items() if tensor.device.type != device]
    assert not stayed, f"{type(target).__name__}.to({device!r}) left {stayed[:5]} behind"
    recast = [name for name, tensor in after.items() if tensor.dtype != before[name]]
    assert not recast, f"{type(target).__name__}.to() changed the dtype of {recast[:5]}"
    assert target.device.type == device


def test_toy_target_moves_every_tensor():
    target = build_tiny_toy_target()
    assert_moves_everything(target, "meta")
    assert target.latent_table().device.type == "meta" and target.lm_embedding_table().device.type == "meta"
    assert target.network.gpt.rotary_table.dtype == torch.float32


@pytest.mark.parametrize("name", ["janus-pro-7b", "lumina-mgpt-7b", "llamagen-xl"])
def test_random_weight_targets_move_every_tensor(name):
    target = random_weights.random_target(name, "tiny", device="cpu")
    float32_buffers = {key for key, tensor in held_tensors(target).items() if tensor.dtype == torch.float32}
    assert_moves_everything(target, "meta")
    assert target.lm_embedding_table().device.type == "meta"
    if name == "lumina-mgpt-7b":  # the two id tables beside the model
        assert target.token_ids.device.type == "meta" and target.interface_index.device.type == "meta"  # type: ignore[attr-defined]
    else:
        assert target.latent_table().device.type == "meta"
    assert float32_buffers == {k for k, t in held_tensors(target).items() if t.dtype == torch.float32}


def test_random_targets_stay_on_the_cpu_unless_asked(monkeypatch):
    """On a CUDA host a random target without `device=` must not go to the GPU behind a CPU test's back."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    target = random_weights.random_target("llamagen-xl", "tiny")
    assert target.device == torch.device("cpu") and target.image_head_weight().dtype == torch.float32


def test_toy_loader_builds_on_the_device_it_is_given():
    shipped = shared_target("toy", {}, device="meta")
    try:
        assert shipped.device.type == "meta"
        assert all(tensor.device.type == "meta" for tensor in held_tensors(shipped).values())
        assert shared_target("toy", {}, device="meta") is shipped  # one instance per process and device
        assert shared_target("toy", {}).device == torch.device("cpu")  # another device, another instance
    finally:
        shared_target.cache_clear()  # type: ignore[attr-defined]


def test_fit_start_moves_a_target_set_up_without_a_trainer(tiny_target, monkeypatch):
    """The fallback: a system set up before it had a trainer gets its target moved once, by `.to`, never an error."""
    system = DrafterSystem(target="toy", preset="tiny")
    system.frozen_target = tiny_target
    monkeypatch.setattr(DrafterSystem, "device", property(lambda self: torch.device("meta")))
    monkeypatch.setattr(DrafterSystem, "global_rank", property(lambda self: 1))  # no banner
    system.on_fit_start()
    assert system.frozen_target is tiny_target and tiny_target.device.type == "meta"
