"""export/: torch.export capture with our decomposition table."""
from .capture import CapturedGraph, InputSpec, capture
from .decomp import decomposition_table

__all__ = ["capture", "CapturedGraph", "InputSpec", "decomposition_table"]
