"""The simulated vLLM engine (``routerd sim-engine``): vLLM's HTTP surface and metrics over a
continuous-batching model with deterministic output and injectable faults."""

from ..sim_tokens import expected_text
from .config import SimConfig
from .engine import SimStats
from .faults import Faults
from .server import SimEngine

__all__ = ["Faults", "SimConfig", "SimEngine", "SimStats", "expected_text"]
