"""Fit a training step into a byte budget (docs/api.md section 10): the decision and its glue.

``tensorscope.fit.offload`` offloads the tensors autograd saves for backward, per block.
"""
