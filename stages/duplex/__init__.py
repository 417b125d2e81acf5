"""Native full duplex: the Moshi LM as a slot-pooled streaming step (see ``lm.py``)."""

from .lm import DuplexLM, DuplexSampling, DuplexStep
from .loader import dummy_duplex_lm, load_duplex_lm

__all__ = ["DuplexLM", "DuplexSampling", "DuplexStep", "dummy_duplex_lm", "load_duplex_lm"]
