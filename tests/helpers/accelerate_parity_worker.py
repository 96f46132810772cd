"""What a Transformers ``*_no_trainer.py`` script relies on, run the same way on ``accelerate`` itself and
on ``app.distributed`` (the imports rewritten module for module, as the README says), so that a test
can compare the two: the logger's keywords, the random numbers a pass over a prepared loader consumes,
the batches each rank gets from a shuffled loader, and a second loader's own generator.

    python tests/helpers/accelerate_parity_worker.py app|accelerate OUT.json
    torchrun --nproc_per_node=2 tests/helpers/accelerate_parity_worker.py app|accelerate OUT.json

Every rank writes ``OUT.json.<rank>``; ranks log to ``OUT.json.log`` (one file, appended to, so the
order of their lines is the order they logged in). Run 2-process ``accelerate`` with
``ACCELERATE_USE_CPU=1``, as ``accelerate launch --cpu`` does.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SEED = 1234


def rng_digest() -> str:
    """The global torch RNG's state, read without drawing from it."""
    import torch

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def passes(loader: Any, n: int = 2) -> dict[str, Any]:
    """The indices of this rank's batches in ``n`` passes, and the RNG state after each pass."""
    batches, after = [], []
    for _ in range(n):
        batches.append([batch["idx"].tolist() for batch in loader])
        after.append(rng_digest())
    return {"batches": batches, "rng_after_pass": after}


def main(package: str, out: Path) -> None:
    import torch
    from torch.utils.data import DataLoader

    root = "app.distributed" if package == "app" else "accelerate"
    accelerate = importlib.import_module(root)
    utils = importlib.import_module(f"{root}.utils")
    get_logger = importlib.import_module(f"{root}.logging").get_logger

    class Rows(torch.utils.data.Dataset):
        """Map-style rows of a dict (as a tokenized ``datasets.Dataset`` yields them)."""

        def __init__(self, n: int):
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"idx": torch.tensor(i)}

    accelerator = accelerate.Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    report: dict[str, Any] = {"package": package, "rank": rank, "world": world}

    # The logger, as the scripts call it (logging.basicConfig, then main_process_only / in_order).
    handler = logging.FileHandler(f"{out}.log", mode="a")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(filename)s:%(funcName)s %(message)s"))
    logger = get_logger("parity")
    logger.logger.addHandler(handler)
    logger.logger.setLevel(logging.INFO)
    logger.info("main process only")
    logger.info(f"every process {rank}", main_process_only=False)
    logger.info(f"in order {rank}", in_order=True)
    logger.debug("below the level")
    if package == "app":
        # Ours on purpose: a process whose level leaves the message out still joins the barriers (under
        # Accelerate it skips them and the others wait for it forever).
        quiet = get_logger("parity.quiet")  # its records reach the handler of "parity"
        quiet.logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
        quiet.info(f"in order, only where enabled {rank}", in_order=True)
    accelerator.wait_for_everyone()
    handler.close()

    utils.set_seed(SEED)
    report["rng_after_seed"] = rng_digest()
    # An unshuffled loader: each pass draws its workers' base seed from the global RNG, as a plain one.
    evaluation = accelerator.prepare(DataLoader(Rows(10), batch_size=2))
    report["rng_after_prepare_unshuffled"] = rng_digest()
    report["unshuffled"] = passes(evaluation)
    # A shuffled loader: on several processes its sampler gets a generator seeded from the global RNG.
    train = accelerator.prepare(DataLoader(Rows(13), batch_size=3, shuffle=True))
    report["rng_after_prepare_shuffled"] = rng_digest()
    report["shuffled"] = passes(train)
    # A second shuffled loader, prepared later with its own generator: it follows that generator.
    own = torch.Generator().manual_seed(7)
    report["own_generator"] = passes(accelerator.prepare(DataLoader(Rows(11), batch_size=2, shuffle=True,
                                                                    generator=own)))
    # A third, without one: seeded from the global RNG again (a new draw, not the first loader's seed).
    report["third_shuffled"] = passes(accelerator.prepare(DataLoader(Rows(11), batch_size=2, shuffle=True)))
    # Accelerate's seedable sampler: the order from data_seed + epoch, one global draw per pass still.
    seeded = accelerate.Accelerator(dataloader_config=utils.DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                     data_seed=5))
    report["seedable"] = passes(seeded.prepare(DataLoader(Rows(9), batch_size=2, shuffle=True)))
    report["seedable_unshuffled"] = passes(seeded.prepare(DataLoader(Rows(5), batch_size=2)))
    accelerator.wait_for_everyone()
    Path(f"{out}.{rank}").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Accelerate's gloo process group can hang in its destructor at exit on CPU (FIELD-NOTES): the
    # report is written, so leave without running it, the same way for both packages.
    os._exit(0)
