"""Whether the Hugging Face hub can be reached, answered in seconds instead of minutes of retries."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """None if the hub answers a TCP connect; otherwise why not (offline mode, DNS, timeout)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return None
    except OSError as e:
        return f"cannot connect to {host}:443 ({e})"
