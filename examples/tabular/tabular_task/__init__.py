"""A task from outside ``app/``: a tabular classifier on data it generates, for ``python -m app``.

    cd examples/tabular
    python -m app --config-dir conf task=tabular

``conf/task/tabular.yaml`` names :class:`TabularTask` with ``_target_``; its keys are the fields of
:class:`TabularConfig`, which the app checks as it checks its own (an unknown key or a wrong type is
refused before anything runs).
"""

from tabular_task.config import TabularConfig
from tabular_task.task import TabularTask

__all__ = ["TabularConfig", "TabularTask"]
