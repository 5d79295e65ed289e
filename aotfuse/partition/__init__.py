"""partition/: (--train) min-cut split of the joint graph into forward and backward graphs, with recompute
and bit-packed boolean activations; `train_graphs` turns the split into the two programs to schedule."""
from .mincut import Partition, SavedTensor, is_banned, op_class, partition
from ..packops import pack_bits, packed_nbytes, unpack_bits
from .programs import step_graphs, train_graphs
from .step import STEP_MODES, step_mode

__all__ = ["partition", "Partition", "SavedTensor", "is_banned", "op_class", "pack_bits", "unpack_bits",
           "packed_nbytes", "train_graphs", "step_graphs", "step_mode", "STEP_MODES"]
