"""Stage: the captured FX graph -> LoopGraph (`graph.lower`), by the rules in `registry.REGISTRY`."""
from .ctx import LoweringCtx
from .graph import lower
from .registry import REGISTRY, OpInfo

__all__ = ["LoweringCtx", "OpInfo", "REGISTRY", "lower"]
