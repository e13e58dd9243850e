"""The chunked-loss part: an HF causal LM's head and cross-entropy in row chunks (fit/chunkloss.py,
fit/causal_lm.py) when a decision chooses it -- the logits and their gradient never whole.

# NOTE [when the loss runs in chunks]
# The chunked loss sums its rows in another order than the plain head and loss, so results are
# allclose to plain (float32: rtol 1e-5), not its bits (api.md §10): it is one more choice of
# the decision, never the default. The decision takes it where nothing fits without it, or
# where it is predicted at least 5% faster (decide.py CHUNKED_GAIN: the loss region's memory --
# the logits, their float32 copy and gradients -- makes the plain loss's plan recompute blocks
# or move state); otherwise the plain loss wins.
# Its memory is the account's (NOTE [the head and its loss in chunks], fit/account.py); its
# time is counted as the plain head's and loss's (measured on this machine at 32 MiB chunks:
# 1.01x the plain head and loss, benchmarks/chunked_loss.py). The measured step (step 1) runs
# the model's own forward, so the recording shows the logits the decision reasons about.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorscope.errors import TensorScopeError
from tensorscope.fit.chunkloss import CHUNK_BYTES, chunk_rows, chunk_rows_for
from tensorscope.fit.parts import Decided, Part, Step

__all__ = ["ChunkedLoss"]


class ChunkedLoss(Part):
    """Holds the chunked forward of a causal LM (made at attach when the model is one; the
    forward is installed only while a decision chunks the loss).

    Attributes:
        why_not: why the loss cannot run in chunks (``""``: it can).
        chunk_bytes: a chunk's float32 logits take about this many bytes.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.why_not = "not attached"
        self._chunker: object | None = None  # causal_lm.ChunkedCausalLM (imports transformers)

    @property
    def chunked_calls(self) -> int:
        """Forwards that ran their loss in chunks so far."""
        return int(getattr(self._chunker, "chunked", 0))

    @property
    def last_reason(self) -> str | None:
        """Why the last forward with the chunked loss installed ran whole (None: it did not)."""
        reason = getattr(self._chunker, "last_reason", None)
        return reason if isinstance(reason, str) else None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        try:
            import transformers  # noqa: F401  (the chunked loss is for transformers models)
        except ImportError:
            self.why_not = "transformers is not installed"
            return
        from tensorscope.fit.causal_lm import ChunkedCausalLM

        try:
            chunker = ChunkedCausalLM(model, chunk_bytes=self.chunk_bytes)
        except TensorScopeError as exc:
            self.why_not = str(exc).removeprefix("tensorscope.fit: ")
            return
        self._chunker = chunker
        self.why_not = chunker.reason or ""

    def head(self) -> tuple[int, int, int, int] | None:
        """``(vocab, hidden, weight element size, hidden element size)`` of the head when the
        loss can run in chunks, else None."""
        from tensorscope.fit.causal_lm import ChunkedCausalLM, output_embeddings

        chunker = self._chunker
        if not isinstance(chunker, ChunkedCausalLM) or chunker.reason is not None:
            return None
        weight = output_embeddings(chunker.model).weight
        size = weight.element_size()  # the hidden states are in the head's dtype
        return int(weight.shape[0]), int(weight.shape[1]), size, size

    def rows(self) -> int:
        """Rows per chunk (0: the loss cannot run in chunks)."""
        head = self.head()
        return 0 if head is None else chunk_rows_for(head[0], self.chunk_bytes)

    def extra_bytes(self, rows: int) -> int:
        """What the chunked loss holds over the loss region for ``rows`` rows of hidden states
        (NOTE [the head and its loss in chunks], fit/account.py); 0 when it cannot run."""
        head = self.head()
        if head is None:
            return 0
        vocab, hidden, weight_size, hidden_size = head
        rows_each = chunk_rows(rows, vocab, self.chunk_bytes)
        grad_weight = vocab * hidden * 4 + vocab * 4  # float32, and a bias's
        grad_hidden = rows * hidden * hidden_size
        # a chunk's logits in float32 (the same buffer becomes their gradient); in another
        # dtype also the head's own output and the gradient cast back, and a V x H product
        lower = weight_size != 4
        chunk = rows_each * vocab * (4 + 2 * weight_size * lower)
        product = vocab * hidden * weight_size * lower
        return grad_weight + grad_hidden + chunk + product

    def decide(self, decided: Decided) -> bool:
        self._set(decided.decision.chosen.base.chunked_loss)
        return True

    def _set(self, on: bool) -> None:
        from tensorscope.fit.causal_lm import ChunkedCausalLM

        chunker = self._chunker
        if not isinstance(chunker, ChunkedCausalLM):
            return
        if on and not chunker.attached:
            chunker.attach()
        elif not on and chunker.attached:
            chunker.detach()

    def step_start(self, step: Step) -> None:
        if step.measured:  # the recording measures the model's own head and loss
            self._set(False)

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        return ()

    def detach(self) -> None:
        self._set(False)
