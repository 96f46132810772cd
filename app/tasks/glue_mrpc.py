"""GLUE MRPC: does a sentence pair paraphrase? Accuracy and binary F1 (app/tasks/glue does the rest).

What is MRPC's own: a paraphrase is one both ways, so training can add every pair in the other order
(``task.swap_pairs``) and evaluation can score each pair in both orders and average them
(``task.symmetric_eval``). The data description (columns, labels, TSV headers) is ``MRPC`` in the
schema's module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.tasks.glue.batches import with_swapped_pairs
from app.tasks.glue.sources import Split
from app.tasks.glue.task import GlueTask
from app.tasks.glue_mrpc_config import GlueMrpcConfig

if TYPE_CHECKING:
    import datasets


class GlueMrpcTask(GlueTask):
    cfg: GlueMrpcConfig

    def __init__(self, cfg: GlueMrpcConfig):
        super().__init__(cfg)

    def _tokenize_train(self, split: Split) -> datasets.Dataset:
        train = self._tokenize(split, "train")
        if not self.cfg.swap_pairs:
            return train
        import datasets

        return datasets.concatenate_datasets([train, self._tokenize(split, "train", swap=True)])

    def _tokenize_eval(self, split: Split, name: str) -> datasets.Dataset:
        """Evaluation rows: the pair, and with ``symmetric_eval`` the swapped pair beside it."""
        plain = self._tokenize(split, name)
        if not self.cfg.symmetric_eval:
            return plain
        return with_swapped_pairs(plain, self._tokenize(split, name, swap=True))
