"""Real DeepSpeed ZeRO through Lightning on CPU processes: for tests and CPU-only machines, never production.

    from training.deepspeed_cpu import CPUDeepSpeedStrategy
    Trainer(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=2, logging_batch_size_per_gpu=4))

Why it exists: production trains with Lightning's stock `DeepSpeedStrategy` on GPUs, but the code
paths DeepSpeed changes (ZeRO-partitioned gradients and optimizer state, the engine's own backward
and step, the checkpoint directory layout and its fp32 consolidation) should be tested on machines
without a GPU. DeepSpeed itself runs on CPU (its CPU accelerator, gloo collectives); Lightning
refuses it. This subclass removes exactly the CUDA assumptions (docs/architecture.md, section "DeepSpeed on CPU"):

1. `setup_environment` raises `RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs
   but CPUAccelerator is used`: skipped (DDPStrategy's environment setup runs instead).
2. `setup_distributed` validates CUDA device indices (`The selected device indices [None, None]
   don't match the local rank values of processes`): replaced by the same steps minus the check.
3. `deepspeed.initialize` gets `device_rank=root_device.index`, which is None for a CPU device, and
   the engine fails with `TypeError: '>=' not supported between instances of 'NoneType' and 'int'`:
   the local rank is passed instead (in training and in the inference engine of validate/test/predict).
4. DeepSpeed's CPU accelerator JIT-compiles the `deepspeed_shm_comm` C++ op (g++ + ninja, about a
   minute) when the process group starts; `skip_shm_comm_op` turns it off, and gloo does the
   collectives alone.

Use the client optimizer (`configure_optimizers` returning a torch optimizer, as `DrafterSystem`
does): an `"optimizer"` section in the DeepSpeed config builds FusedAdam, another JIT compile.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from torch.nn import Module
from torch.optim import Optimizer

SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Make DeepSpeed's communication backend use plain gloo instead of compiling its shared-memory op."""
    import deepspeed

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy` without its CUDA assumptions (module docstring); same arguments.

    Args:
        compile_shm_comm_op: let DeepSpeed JIT-compile its shared-memory communication op (cached in
            TORCH_EXTENSIONS_DIR afterwards); False (the default) uses gloo alone.
        *args, **kwargs: `DeepSpeedStrategy`'s (stage, config, logging_batch_size_per_gpu, ...).
    """

    def __init__(self, *args: Any, compile_shm_comm_op: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile_shm_comm_op = compile_shm_comm_op

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only guard

    def setup_distributed(self) -> None:
        if not self.compile_shm_comm_op:
            skip_shm_comm_op()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """The stock method (validate / test / predict outside fit) with device_rank = the local rank."""
        import deepspeed

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine
