"""Accelerate's ``DummyOptim`` and ``DummyScheduler``: stand-ins for an optimizer and a scheduler that a
DeepSpeed config file defines. There is no DeepSpeed here (``accelerator.state.deepspeed_plugin`` is
None), so a script written for both cases, as Accelerate's examples are, imports them and then picks a
real optimizer and scheduler:

>>> from app.distributed.utils import DummyOptim, DummyScheduler, set_seed
>>> optimizer_cls = torch.optim.AdamW if accelerator.state.deepspeed_plugin is None else DummyOptim

``Accelerator.prepare`` refuses a placeholder with one sentence: nothing would ever step it."""

from __future__ import annotations

from typing import Any


class DummyOptim:
    """Holds the parameters and hyper-parameters for an optimizer a DeepSpeed config defines (Accelerate's signature)."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Holds the settings of a scheduler a DeepSpeed config defines (Accelerate's signature)."""

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Any = None, **kwargs: Any):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def refuse_placeholder(obj: Any) -> None:
    """One sentence for a placeholder handed to ``prepare``."""
    if isinstance(obj, (DummyOptim, DummyScheduler)):
        real = "a torch optimizer" if isinstance(obj, DummyOptim) else "a torch LR scheduler"
        raise TypeError(f"prepare() got a {type(obj).__name__}, a placeholder for what a DeepSpeed config defines; "
                         f"there is no DeepSpeed here (accelerator.state.deepspeed_plugin is None): pass {real}.")
