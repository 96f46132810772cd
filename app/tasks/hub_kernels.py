"""Whether transformers may swap a model's layers for kernels from the Hugging Face Hub.

Since 5.25, transformers depends on the ``kernels`` package and ``from_pretrained`` kernelizes every
model by default: layers with a Hub kernel (RMSNorm, MLPs...) get code fetched from the Hub, and
``model.train()`` re-kernelizes for the new mode. The app turns that off unless the user asks
(``USE_HUB_KERNELS=YES``), for three reasons: a run must not fetch and run code from the Hub that its
config does not name, the numerics of a resumed or exported model must not depend on what the Hub
served that day, and the ``kernels`` library refuses XLA devices outright (``model.train()`` raises
"Unsupported device type 'xla'"), so on ``hardware=tpu`` it stays off even when asked.

transformers reads the variable at each ``from_pretrained``; the processes the app starts inherit it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

ENV = "USE_HUB_KERNELS"
_ASKED = {"true", "1", "y", "yes", "on"}  # transformers' reading of a true environment variable


def choose_hub_kernels(on_xla: bool, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``USE_HUB_KERNELS`` for this run: off unless the user set it, always off on XLA. Returns
    whether Hub kernels may be used."""
    asked = environ.get(ENV, "").lower() in _ASKED
    if on_xla:
        if asked:
            log.warning("%s=%s ignored: Hub kernels do not run on XLA devices (hardware=tpu); the model keeps "
                        "its PyTorch layers.", ENV, environ[ENV])
        environ[ENV] = "NO"
        return False
    environ.setdefault(ENV, "NO")
    return asked
