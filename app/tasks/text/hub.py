"""Hub access that fails fast when the Hugging Face hub cannot be reached.

Without it, huggingface_hub retries an unreachable hub with backoff for about 25 s per file before
giving up. Nothing here is GLUE's own: any loader of hub models, tokenizers or datasets can use it.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse


@contextlib.contextmanager
def hub_access(name: str) -> Iterator[None]:
    """Hub offline mode for the block when a quick probe finds the hub unreachable.

    A local folder ``name`` needs no hub. Offline mode still serves files already in the local HF cache.
    """
    import datasets.config
    from huggingface_hub import constants

    if (
        Path(name).expanduser().is_dir()
        or constants.HF_HUB_OFFLINE
        or _endpoint_reachable(constants.ENDPOINT)
    ):
        yield
        return
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@functools.lru_cache(maxsize=8)
def _endpoint_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub endpoint (or, behind a proxy, to the proxy)?"""
    import urllib.request

    url = urlparse(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy:  # behind a proxy, the proxy is what must answer
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if host is None:
        return True  # cannot tell: let the libraries try
    reached: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=timeout_s).close()
            reached.append(True)

    # A thread, because name resolution ignores socket timeouts and can hang on a broken resolver.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return bool(reached)
