"""``FitCallback(budget=...)``: ``ts.fit`` for a Hugging Face ``Trainer`` (docs/fit.md).

``transformers`` is imported when ``FitCallback`` is first looked up, not when this module is.

Example:
    >>> from tensorscope.integrations.transformers import FitCallback
    >>> callback = FitCallback(budget="3GiB")   # Trainer(..., callbacks=[callback])
    >>> callback.fit is None                    # made at on_train_begin
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorscope.fit.handle import Fit

__all__ = ["FitCallback"]  # noqa: F822 (made at first use: see __getattr__)

# NOTE [the Trainer's step]
# The Trainer makes its optimizer inside train(), after the callbacks exist, and hands it to
# `on_train_begin` (kwargs "model", "optimizer": accelerate's AcceleratedOptimizer, which ts.fit
# unwraps). The callback fits there and removes the fit at `on_train_end`, so the model leaves
# train() as it came. Its loop is what ts.fit expects: forward, backward, (clip_grad_norm_ when
# max_grad_norm > 0: gradients then stay until the step), optimizer.step(), scheduler.step(),
# zero_grad(). Gradient accumulation (several forwards per optimizer step) is seen in the first
# step and keeps gradients as well.

_class: type | None = None


def _make_class() -> type:
    from transformers import TrainerCallback

    from tensorscope.errors import InvalidArgumentError
    from tensorscope.fit import fit

    class FitCallback(TrainerCallback):
        """Fit the Trainer's training step into ``budget`` (bytes or ``"3GiB"``) with
        ``ts.fit``; ``callback.fit`` is the handle (``explain()``, ``plan_before``, ...),
        kept after training ends (removed)."""

        def __init__(self, budget: int | str, *, blocks: str | None = None) -> None:
            self.budget = budget
            self.blocks = blocks
            self.fit: Fit | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
            if model is None or optimizer is None:
                raise InvalidArgumentError(
                    "tensorscope.fit: FitCallback needs the Trainer's model and optimizer at "
                    "on_train_begin; this Trainer passed none (transformers too old?)"
                )
            if self.fit is not None and not self.fit.removed:
                self.fit.remove()
            self.fit = fit(model, optimizer, self.budget, blocks=self.blocks)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.fit is not None:
                self.fit.remove()

    return FitCallback


def __getattr__(name: str) -> Any:
    global _class
    if name == "FitCallback":
        if _class is None:
            _class = _make_class()
        return _class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
