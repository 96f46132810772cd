"""Whether transformers may swap a model's layers for kernels from the Hugging Face Hub.

Since 5.25, transformers depends on the ``kernels`` package and ``from_pretrained`` kernelizes every
model by default: layers with a Hub kernel (RMSNorm, MLPs...) get code fetched from the Hub, and
``model.train()`` kernelizes again for the new mode. The app turns that off unless the user asks
(``USE_HUB_KERNELS=YES``): a run must not fetch and run code from the Hub that its config does not
name, and the numerics of a resumed or exported model must not depend on what the Hub served that
day. Where the ``kernels`` library refuses the kind's devices (``model.train()`` raises "Unsupported
device type"), it stays off even when asked.

transformers reads the variable at each ``from_pretrained``. The default is set before the launcher's
fork server starts, so that every process the app starts inherits it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

ENV = "USE_HUB_KERNELS"
_ASKED = {"true", "1", "y", "yes", "on"}  # transformers' reading of a true environment variable


def hub_kernels_off_by_default(environ: MutableMapping[str, str] | None = None) -> None:
    """``USE_HUB_KERNELS=NO`` unless the user set it. ``environ``: this process's environment, looked up at the
    call (``datasets.map(num_proc=...)`` replaces ``os.environ`` with a copy: a default bound at import would
    write to the old one, which ``os.getenv`` no longer reads)."""
    (os.environ if environ is None else environ).setdefault(ENV, "NO")


def keep_hub_kernels_off(kind: str, environ: MutableMapping[str, str] | None = None) -> None:
    """For ``hardware=<kind>``, whose devices the ``kernels`` library refuses (a single-process kind:
    no worker has inherited the user's choice): off even when asked, and the log says so."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV, "").lower() in _ASKED:
        log.warning("%s=%s ignored: Hub kernels do not run on hardware=%s's devices; the model keeps its PyTorch "
                    "layers.", ENV, environ[ENV], kind)
    environ[ENV] = "NO"
