"""Stage: the captured FX graph -> LoopGraph (`graph.lower`), by the rules in `registry.registry()`."""
from .ctx import LoweringCtx
from .graph import lower
from .registry import OpInfo, registry

__all__ = ["LoweringCtx", "OpInfo", "lower", "registry"]
