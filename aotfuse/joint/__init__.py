"""joint/: (--train) the joint forward+backward FX graph, traced by aot_autograd with our decompositions."""
from .decomp_train import sdpa_math, training_decompositions
from .trace import JointGraph, trace_joint

__all__ = ["trace_joint", "JointGraph", "training_decompositions", "sdpa_math"]
