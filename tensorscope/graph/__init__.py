"""Step recording (after Apache SINGA's graph mode): the ops of one iteration and the tensors
each touches, so the next iteration knows every tensor's next use."""

from tensorscope.graph.analysis import NextUse, next_use_table
from tensorscope.graph.record import Recorder, Trace

__all__ = ["NextUse", "Recorder", "Trace", "next_use_table"]
