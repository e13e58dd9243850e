"""FitCallback: ts.fit inside a real (tiny) Hugging Face Trainer run, weights equal a plain run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .fit_helpers import BIG_VOCAB, VOCAB, big_vocabulary, differing, plain_peak, tiny

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)

transformers = pytest.importorskip("transformers")


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, vocab: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, vocab, (16, 32), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    tmp: Any, callbacks: list[Any], max_grad_norm: float, vocab: int = VOCAB
) -> torch.nn.Module:
    model = tiny("gpt2") if vocab == VOCAB else big_vocabulary("gpt2")
    args = transformers.TrainingArguments(
        output_dir=str(tmp),
        per_device_train_batch_size=4,
        max_steps=5,
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        seed=7,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(vocab), callbacks=callbacks
    )
    trainer.train()
    return model


@pytest.mark.parametrize("max_grad_norm", [1.0])
def test_trainer_with_fit_callback_trains_like_plain(tmp_path: Any, max_grad_norm: float) -> None:
    from tensorscope.integrations.transformers import FitCallback

    budget = int(plain_peak("gpt2", "adamw") * 0.7)
    callback = FitCallback(budget=budget)
    fitted = train(tmp_path / "fit", [callback], max_grad_norm)
    plain = train(tmp_path / "plain", [], max_grad_norm)
    assert differing(fitted, plain) == []
    fit = callback.fit
    assert fit is not None and fit.removed  # removed at on_train_end: the model is plain again
    assert all("forward" not in block.__dict__ for block in fitted.transformer.h)
    assert fit.decision is not None
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
    # the Trainer clips (max_grad_norm > 0) and, in transformers 5, computes the gradient norm
    # for its log every step even without clipping: the gradients must all exist at once
    assert not fit.decision.free_gradients
    assert "reads gradients outside backward" in fit.explain()
    assert {"recompute", "offload"} & set(fit.decision.blocks)


def test_trainer_loss_runs_in_place_and_trains_like_plain(tmp_path: Any) -> None:
    # the Trainer passes num_items_in_batch: HF's loss sums, then divides (reduction "sum")
    from tensorscope.integrations.transformers import FitCallback

    callback = FitCallback(budget="1GiB")
    fitted = train(tmp_path / "fit", [callback], 1.0, vocab=BIG_VOCAB)
    plain = train(tmp_path / "plain", [], 1.0, vocab=BIG_VOCAB)
    assert differing(fitted, plain) == []
    assert callback.fit is not None and callback.fit.loss_routed == 5


@pytest.mark.filterwarnings(
    "ignore:.*(the measuring step|first step):tensorscope.errors.FitWarning"
)
def test_trainer_steps_one_parameter_at_a_time_when_only_that_fits(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Trainer clips, so gradients are kept; below what the whole state needs at the
    # optimizer step, the step runs one parameter at a time (fit/statestore.py). The chunked
    # LM loss is taken out of the choices: at this budget it is predicted faster than moving
    # the state (tests/fit/test_fit_chunked.py), and this test is about the state's path
    from tensorscope.fit.parts.chunked import ChunkedLoss
    from tensorscope.integrations.transformers import FitCallback

    monkeypatch.setattr(ChunkedLoss, "head", lambda self: None)

    probe = FitCallback(budget="1GiB")
    train(tmp_path / "probe", [probe], 1.0, vocab=BIG_VOCAB)
    assert probe.fit is not None and probe.fit.decision is not None
    least = {
        c.base.state_offloaded: c.least_budget
        for c in probe.fit.decision.candidates
        if not c.base.free_gradients
    }
    assert least[True] < least[False]
    budget = (least[True] + least[False]) // 2
    callback = FitCallback(budget=budget)
    fitted = train(tmp_path / "fit", [callback], 1.0, vocab=BIG_VOCAB)
    plain = train(tmp_path / "plain", [], 1.0, vocab=BIG_VOCAB)
    assert differing(fitted, plain) == []
    fit = callback.fit
    assert fit is not None and fit.decision is not None
    assert fit.decision.chosen.base.state_offloaded and not fit.decision.free_gradients
    assert fit._states.store is not None and fit._states.store.stepwise_updates > 0
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
