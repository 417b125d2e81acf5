"""Streaming Mimi codec with slot-pooled state (see ``model.py`` and ``pool.py``)."""

from .config import MimiCodecConfig
from .loader import build_mimi, load_mimi
from .model import StreamingMimi
from .pool import MimiSlotPool

__all__ = ["MimiCodecConfig", "MimiSlotPool", "StreamingMimi", "build_mimi", "load_mimi"]
