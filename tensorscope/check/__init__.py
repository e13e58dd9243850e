"""``tensorscope check``: the acceptance of the contract on the best device present (API §12).

``tensorscope check [--device cuda|cpu] [--json PATH]`` (or ``python -m tensorscope.check``)
runs five checks, each in a process of its own under a time limit, and prints a table:

1. ``scopes``: a scope gives ``memory_allocated`` back exactly; a disposed tensor raises;
2. ``record``: ``ts.record``'s peak against the allocator's (per phase; cuBLAS's workspaces
   named where they are the difference);
3. ``moves``: residency round trips device -> host -> disk on real streams, equal bytes;
4. ``managed``: a GPT-2-medium-shaped model at 25% of its weights under Flow and Genoa: logits
   equal plain's, reserved memory within the budget and the step's activations, time against
   plain and accelerate's ``cpu_offload``;
5. ``fit``: ``ts.fit`` of a GPT-2 (12 x 768) at HF checkpointing's peak and at 50% of plain.

On the CPU the same checks run small (under a minute). See docs/accelerators.md.

Layer: above ``fit`` (the checks use every part of tensorscope); imported by ``cli``.
"""

from tensorscope.check.cli import main

__all__ = ["main"]
