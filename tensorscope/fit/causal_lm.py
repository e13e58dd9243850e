"""An HF causal LM's loss in row chunks (chunkloss.py): the model's forward with ``labels=``
runs its base model, then the head and the loss chunk by chunk, and returns its own output
class with ``loss`` set and ``logits=None``. See NOTE [the chunked forward of a causal LM].

Glue: transformers is imported lazily; the form of the model's forward is read by the pure
``headform.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from tensorscope._copies import MISSING, Attached, leave_out_of_copies
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError
from tensorscope.fit.chunkloss import CHUNK_BYTES, chunk_rows, linear_cross_entropy
from tensorscope.fit.headform import HeadForm, read_head_form

__all__ = ["ChunkedCausalLM", "output_embeddings"]

# NOTE [the chunked forward of a causal LM]
# attach() sets the model's `forward` as an instance attribute (the class's stays; copies of
# the model leave it out, _copies.py; detach() gives back exactly what the instance had). A
# call runs chunked only when everything it would do can be reproduced: the model's forward
# is in the plain form (headform.py: base model, last hidden state, head, optional softcap,
# self.loss_function, output class), its loss_function is transformers' ForCausalLMLoss, its
# head is its output embeddings and a plain nn.Linear with no hooks (they would not run), the
# forward is wrapped only by transformers' can_return_tuple and deprecate_kwarg (whose
# renaming is left to the model: a call with the deprecated keyword runs plain), and the call
# is a training one -- train() mode, gradients enabled, `labels` given, logits_to_keep 0, a
# dict returned (a tuple without its logits would move every later position). Anything else
# runs the model's own forward, and `last_reason` says why (explain() shows it). The chunked
# call mirrors the form: the config defaults, the base model called with the forward's own
# arguments, ForCausalLMLoss's shift (labels padded with ignore_index and moved left by one,
# or the caller's shift_labels), its ignore_index and num_items_in_batch, the config's
# softcap, and the output class's fields copied from the base model's outputs. generate()
# calls forward without labels: it runs plain, with the model's own signature (kept on the
# instance forward, as generate() reads it).

_RETURN_TUPLE = "can_return_tuple.<locals>.wrapper"
_DEPRECATED = "deprecate_kwarg.<locals>.wrapper.<locals>.wrapped_func"


class ChunkedCausalLM:
    """Computes an HF causal LM's training loss in row chunks while attached (see the NOTE).

    Args:
        model: a transformers causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...).
        chunk_bytes: a chunk's float32 logits take about this many bytes
            (:func:`~tensorscope.fit.chunkloss.chunk_rows_for`).

    Attributes:
        last_reason: why the last call ran the model's own forward (``None``: it ran chunked,
            or no call yet).
        chunked: how many calls ran chunked.

    Raises:
        ArgumentTypeError: ``model`` is not a transformers ``PreTrainedModel``.
        InvalidArgumentError: it is not a causal LM (an encoder-decoder such as T5, no output
            embeddings), or ``chunk_bytes`` is not positive.

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(cfg).train()
        >>> chunked = ChunkedCausalLM(model); chunked.attach()
        >>> ids = torch.randint(0, 64, (2, 5))
        >>> out = model(ids, labels=ids)
        >>> out.logits is None, out.loss.shape, chunked.chunked
        (True, torch.Size([]), 1)
        >>> chunked.detach(); "forward" in vars(model)
        False
    """

    def __init__(self, model: nn.Module, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise ArgumentTypeError(
                f"tensorscope.fit: the chunked LM loss needs a transformers PreTrainedModel, "
                f"got {type(model).__name__}"
            )
        name = type(model).__name__
        if getattr(model.config, "is_encoder_decoder", False):
            raise InvalidArgumentError(
                f"tensorscope.fit: {name} is an encoder-decoder, not a causal LM: its loss is "
                f"not shifted and its decoder takes the labels; the chunked LM loss is for "
                f"causal LMs (GPT-2, Llama, Qwen2, Mistral, ...)"
            )
        if output_embeddings(model) is None:
            raise InvalidArgumentError(
                f"tensorscope.fit: {name} has no output embeddings (LM head): not a causal LM"
            )
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise InvalidArgumentError(
                f"tensorscope.fit: chunk_bytes must be a positive int, got {chunk_bytes!r}"
            )
        self.model = model
        self.chunk_bytes = chunk_bytes
        self.chunked = 0
        self.last_reason: str | None = None
        self._function = inspect.unwrap(type(model).forward)
        self._wrappers = _wrappers(type(model).forward)
        self._signature = inspect.signature(self._function)
        form = _form(self._function)
        self._form = form if isinstance(form, HeadForm) else None
        self._form_reason = form if isinstance(form, str) else None
        if self._form_reason is not None and not _causal(model):
            raise InvalidArgumentError(
                f"tensorscope.fit: {name} is not a causal LM (not in transformers' causal-LM "
                f"mapping, and {self._form_reason}); the chunked LM loss is for causal LMs"
            )
        self._previous: Any = MISSING
        self._original: Callable[..., Any] | None = None
        self._kept_out: Attached | None = None

    @property
    def reason(self) -> str | None:
        """Why no call can run chunked as the model is now (``None``: training calls with
        labels can); see the NOTE."""
        return self._form_reason or self._static_reason()

    @property
    def attached(self) -> bool:
        """Whether the chunked forward is installed on the model."""
        return self._original is not None

    def attach(self) -> None:
        """Install the chunked forward on the model instance (see the NOTE). A model whose
        ``reason`` is not ``None`` gets it too: each call runs its own forward and says why.

        Raises:
            InvalidArgumentError: already attached.
        """
        if self._original is not None:
            raise InvalidArgumentError("tensorscope.fit: the chunked LM loss is already attached")
        model = self.model
        self._previous = model.__dict__.get("forward", MISSING)
        original = model.forward
        chunked = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            return chunked._call(original, args, kwargs)

        functools.update_wrapper(forward, original)  # generate() reads its signature
        forward.__dict__["_tensorscope_chunked"] = self
        self._original = original
        model.__dict__["forward"] = forward
        self._kept_out = leave_out_of_copies(model, attrs={"forward": self._previous})

    def detach(self) -> None:
        """Give the model back the ``forward`` it had before :meth:`attach` (idempotent).

        Raises:
            InvalidArgumentError: another ``forward`` was set on the instance after attach
                (detach that one first).
        """
        if self._original is None:
            return
        model = self.model
        current = model.__dict__.get("forward")
        if getattr(current, "_tensorscope_chunked", None) is not self:
            raise InvalidArgumentError(
                f"tensorscope.fit: {type(model).__name__}.forward was replaced after the "
                f"chunked LM loss was attached (by {current!r}); remove that one first"
            )
        if self._kept_out is not None:
            self._kept_out.remove()
            self._kept_out = None
        if self._previous is MISSING:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = self._previous
        self._previous, self._original = MISSING, None

    # -- a call ----------------------------------------------------------------------------

    def _call(self, original: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        bound = None
        reason = self.reason or self._mode_reason()
        if reason is None:
            try:
                bound = self._signature.bind(self.model, *args, **kwargs)
            except TypeError:
                reason = "its arguments do not bind to its forward's signature"
        if bound is not None and reason is None:
            bound.apply_defaults()
            reason = self._call_reason(bound.arguments)
        if reason is not None or bound is None:
            self.last_reason = reason
            return original(*args, **kwargs)
        self.last_reason = None
        self.chunked += 1
        return self._run(bound.arguments)

    def _static_reason(self) -> str | None:
        """Why the model (as it is now) cannot run chunked; ``None``: it can."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        model, form = self.model, self._form
        if form is None:
            return self._form_reason
        for kind, detail in self._wrappers:
            if kind not in (_RETURN_TUPLE, _DEPRECATED):
                return f"its forward is wrapped by {detail}, which the chunked call cannot mirror"
        if form.output not in self._function.__globals__:
            return f"its output class {form.output} is not found in its module"
        previous = self._previous if self.attached else model.__dict__.get("forward", MISSING)
        if previous is not MISSING:
            return f"its forward was replaced on the instance ({previous!r}) before attach"
        loss_function = getattr(model, "loss_function", None)
        if loss_function is not ForCausalLMLoss:
            name = getattr(loss_function, "__name__", repr(loss_function))
            return f"its loss_function is {name}, not transformers' ForCausalLMLoss"
        head = getattr(model, form.head, None)
        if head is None or head is not output_embeddings(model):
            return f"its head self.{form.head} is not its output embeddings"
        if type(head).forward is not nn.Linear.forward:
            return f"its head is a {type(head).__name__}, not a plain nn.Linear"
        if head._forward_hooks or head._forward_pre_hooks or head._backward_hooks:
            return "its head has module hooks, which would not run"
        vocab = getattr(model.config, "vocab_size", None)
        if vocab != head.out_features:
            return f"its config's vocab_size {vocab} is not its head's {head.out_features} rows"
        return None

    def _mode_reason(self) -> str | None:
        if not self.model.training:
            return "the model is in eval mode"
        if not torch.is_grad_enabled():
            return "gradients are disabled"
        return None

    def _call_reason(self, arguments: dict[str, Any]) -> str | None:
        form = self._form
        assert form is not None  # _static_reason said so
        extra = arguments.get(form.var_keyword, {}) if form.var_keyword else {}
        labels = arguments.get("labels")
        if labels is None:
            return "no labels"
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
            return "its labels are not a tensor of class indices"
        keep = arguments.get("logits_to_keep", 0)
        if type(keep) is not int or keep != 0:
            return f"logits_to_keep={keep!r} (only 0, all positions, runs chunked)"
        for kind, detail in self._wrappers:
            if kind == _DEPRECATED and detail in extra:
                return f"the deprecated keyword {detail}= (the model renames it)"
        if form.tuple_branch is not None:
            return_dict = self._defaults(arguments).get(form.tuple_branch)
        elif any(kind == _RETURN_TUPLE for kind, _ in self._wrappers):
            return_dict = getattr(self.model.config, "return_dict", True)
            passed = extra.get("return_dict", return_dict)
            return_dict = return_dict if passed is None else passed
        else:
            return_dict = True
        if not return_dict:
            return "return_dict=False (a tuple without logits would move every later output)"
        return None

    def _defaults(self, arguments: dict[str, Any]) -> dict[str, Any]:
        form = self._form
        assert form is not None
        for parameter, attribute in form.config_defaults:
            if arguments.get(parameter) is None:
                arguments[parameter] = getattr(self.model.config, attribute)
        return arguments

    def _run(self, arguments: dict[str, Any]) -> Any:
        form = self._form
        assert form is not None
        model, arguments = self.model, self._defaults(dict(arguments))
        extra = dict(arguments.get(form.var_keyword, {})) if form.var_keyword else {}
        if any(kind == _RETURN_TUPLE for kind, _ in self._wrappers):
            extra.pop("return_dict", None)  # can_return_tuple takes it
        base: Any = model
        for name in form.base:
            base = getattr(base, name)
        positional = [arguments[name] for name in form.base_args]
        keywords = {keyword: arguments[name] for keyword, name in form.base_kwargs}
        keywords.update(form.base_constants)
        outputs = base(*positional, **keywords, **(extra if form.base_star else {}))
        hidden = outputs[0] if form.hidden_first else outputs.last_hidden_state
        loss_kwargs = extra if form.loss_star else {}
        ignore_index = loss_kwargs.get("ignore_index", -100)
        shift_labels = loss_kwargs.get("shift_labels")
        if shift_labels is None:  # ForCausalLMLoss's shift
            labels = functional.pad(arguments["labels"], (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        head: nn.Linear = getattr(model, form.head)
        softcap = getattr(model.config, form.softcap) if form.softcap else None
        rows = hidden.numel() // hidden.shape[-1]
        loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            head.bias,
            shift_labels.reshape(-1).to(hidden.device),
            ignore_index=ignore_index,
            chunk_rows=chunk_rows(rows, head.out_features, self.chunk_bytes),
            softcap=softcap,
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
        )
        output = self._function.__globals__[form.output]
        fields = {field: getattr(outputs, attribute) for field, attribute in form.fields}
        return output(loss=loss, logits=None, **fields)


def output_embeddings(model: nn.Module) -> Any:
    """The model's LM head (transformers' ``get_output_embeddings()``)."""
    return model.get_output_embeddings()  # type: ignore[operator]


def _causal(model: nn.Module) -> bool:
    """Whether transformers lists the model's class as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _form(function: Callable[..., Any]) -> HeadForm | str:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return "its forward's source is not available"
    return read_head_form(source)


def _wrappers(forward: Any) -> list[tuple[str, str]]:
    """The decorators' wrappers around a forward, outermost first: ``(code's qualified name,
    detail)``, the detail being a deprecated keyword's old name or the wrapper's module."""
    found = []
    while hasattr(forward, "__wrapped__"):
        code = getattr(forward, "__code__", None)
        kind = code.co_qualname if code is not None else type(forward).__name__
        detail = f"{getattr(forward, '__module__', '?')}.{kind}"
        if kind == _DEPRECATED:
            detail = str(inspect.getclosurevars(forward).nonlocals.get("old_name"))
        found.append((kind, detail))
        forward = forward.__wrapped__
    return found
