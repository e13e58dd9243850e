"""How an HF causal LM's ``forward`` computes its head and loss, read from its source: the
plain form, or the reason it is something else. See NOTE [reading the head's form].

Pure: ``ast`` and ``re``, no torch; ``causal_lm.py`` runs what it reads.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

__all__ = ["HeadForm", "read_head_form"]

# NOTE [reading the head's form]
# To compute an HF causal LM's loss in row chunks (chunkloss.py) without its logits, its
# forward must be run without its last two steps -- `logits = self.lm_head(hidden)` and
# `self.loss_function(logits, labels, ...)` -- and everything else exactly as the model does
# it. transformers' causal LMs mostly share one form (Llama, Qwen2, Mistral, Phi-3, GPT-2,
# GPT-NeoX, OPT, Gemma 2 with its softcap; 4.x spells the slicing and the outputs' cache
# differently), but not all: Mixtral adds a router loss to the loss, some models scale the
# logits, older ones compute the loss by hand. Liger-Kernel keeps one replacement forward per
# model type; here the forward's own source is read instead, statement by statement, against
# that one form: keyword defaults from the config, the base model's call (with which
# arguments), its last hidden state, the logits_to_keep slicing, the head, an optional softcap,
# the loss call, an optional tuple branch, and the output class with the fields it copies
# from the base model's outputs. Any other statement -- anything the chunked path could not
# reproduce exactly -- makes the form a reason string that names it, and the model's own
# forward runs. Comments and docstrings are not statements (ast drops them).

_NAME = r"[A-Za-z_]\w*"


@dataclass(frozen=True)
class HeadForm:
    """A causal LM's forward in the plain form (see the NOTE); what to run in its place.

    Attributes:
        params: the forward's named parameters, ``self`` left out.
        var_keyword: the name of its ``**kwargs`` (``None``: none).
        config_defaults: ``(parameter, config attribute)``: ``p = p if p is not None else
            self.config.a`` statements, in order.
        base: the base model's attribute path from the model (``("model", "decoder")``).
        base_args: the base model's positional arguments (parameter names).
        base_kwargs: ``(keyword, parameter name)`` for its keyword arguments.
        base_constants: ``(keyword, literal)`` (``return_dict=True``).
        base_star: whether ``**kwargs`` goes to the base model.
        hidden_first: the hidden states are ``outputs[0]`` (else ``.last_hidden_state``).
        sliced: whether ``logits_to_keep`` slices the hidden states before the head.
        head: the head's attribute name (``"lm_head"``).
        softcap: the config attribute of a final logit softcap (``None``: none).
        loss_star: whether ``**kwargs`` goes to ``self.loss_function``.
        output: the output class's name, in the forward's module.
        fields: ``(field, attribute of the base model's outputs)`` the output copies.
        tuple_branch: the parameter whose false value returns a tuple (``None``: none).
    """

    params: tuple[str, ...]
    var_keyword: str | None
    config_defaults: tuple[tuple[str, str], ...]
    base: tuple[str, ...]
    base_args: tuple[str, ...]
    base_kwargs: tuple[tuple[str, str], ...]
    base_constants: tuple[tuple[str, bool | int | str | None], ...]
    base_star: bool
    hidden_first: bool
    sliced: bool
    head: str
    softcap: str | None
    loss_star: bool
    output: str
    fields: tuple[tuple[str, str], ...]
    tuple_branch: str | None


class _Refused(Exception):
    """A statement outside the plain form (the message says which)."""


def read_head_form(source: str) -> HeadForm | str:
    """Read a causal LM's ``forward`` source (a ``def``, indented or not) into its
    :class:`HeadForm`, or return why it is not in the plain form (see the NOTE).

    Example:
        >>> form = read_head_form('''
        ... def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        ...     outputs = self.model(input_ids=input_ids, **kwargs)
        ...     hidden_states = outputs.last_hidden_state
        ...     hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
        ...     logits = self.lm_head(hidden_states)
        ...     loss = None
        ...     if labels is not None:
        ...         loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        ...     return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
        ... ''')
        >>> form.base, form.head, form.output, form.fields
        (('model',), 'lm_head', 'CausalLMOutputWithPast', (('cache', 'cache'),))
        >>> read_head_form("def forward(self, x):\\n    return self.net(x)\\n")
        'its forward has no base model call before `return self.net(x)`'
    """
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as error:
        return f"its forward's source does not parse ({error.msg})"
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return "its forward's source is not one function"
    fn = tree.body[0]
    if fn.args.vararg is not None:
        return f"its forward takes *{fn.args.vararg.arg}"
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    reader = _Reader(tuple(names[1:]), fn.args.kwarg.arg if fn.args.kwarg else None)
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    try:
        for statement in body:
            reader.take(statement)
        return reader.form()
    except _Refused as refused:
        return str(refused)


def _line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


class _Reader:
    """The plain form's steps, in order; each statement must be the next step (or skip the
    optional ones before it)."""

    def __init__(self, params: tuple[str, ...], var_keyword: str | None) -> None:
        self.params, self.var_keyword = params, var_keyword
        self.defaults: list[tuple[str, str]] = []
        self.step = "defaults"
        self.outputs = self.hidden = self.slice_name = self.logits = ""
        self.base: tuple[str, ...] = ()
        self.base_args: tuple[str, ...] = ()
        self.base_kwargs: list[tuple[str, str]] = []
        self.base_constants: list[tuple[str, bool | int | str | None]] = []
        self.base_star = self.hidden_first = self.sliced = self.loss_star = False
        self.head = self.output = ""
        self.softcap: str | None = None
        self.tuple_branch: str | None = None
        self.fields: tuple[tuple[str, str], ...] = ()

    def take(self, s: ast.stmt) -> None:
        text = ast.unparse(s)
        if self.step == "defaults":
            m = re.fullmatch(rf"({_NAME}) = \1 if \1 is not None else self\.config\.(\w+)", text)
            if m and m[1] in self.params:
                self.defaults.append((m[1], m[2]))
                return
            self._base(s)
        elif self.step == "hidden":
            m = re.fullmatch(rf"({_NAME}) = {self.outputs}(\.last_hidden_state|\[0\])", text)
            if not m:
                raise _Refused(self._why(s, "the base model's last hidden state"))
            self.hidden, self.hidden_first, self.step = m[1], m[2] == "[0]", "slice"
        elif self.step == "slice" and self._slice(text):
            self.sliced, self.step = True, "head"
        elif self.step in ("slice", "head"):
            self._head(s, text)
        elif self.step == "softcap" and isinstance(s, ast.If) and "tanh" in text:
            self._softcap(s)
        elif self.step in ("softcap", "loss_none"):
            if text != "loss = None":
                raise _Refused(self._why(s, "`loss = None`"))
            self.step = "loss"
        elif self.step == "loss":
            self._loss(s)
        elif self.step == "tuple" and isinstance(s, ast.If) and not s.orelse:
            m = re.fullmatch(rf"not ({_NAME})", ast.unparse(s.test))
            if not m or m[1] not in self.params:
                raise _Refused(self._why(s, "the output"))
            self.tuple_branch, self.step = m[1], "return"
        elif self.step in ("tuple", "return"):
            self._return(s)
        else:
            raise _Refused(f"its forward goes on after its return: `{_line(s)}`")

    def form(self) -> HeadForm:
        if self.step != "done":
            raise _Refused(f"its forward ends before {self.step!r} of the plain form")
        return HeadForm(
            self.params,
            self.var_keyword,
            tuple(self.defaults),
            self.base,
            self.base_args,
            tuple(self.base_kwargs),
            tuple(self.base_constants),
            self.base_star,
            self.hidden_first,
            self.sliced,
            self.head,
            self.softcap,
            self.loss_star,
            self.output,
            self.fields,
            self.tuple_branch,
        )

    def _why(self, s: ast.stmt, expected: str) -> str:
        return f"its forward's `{_line(s)}` is not {expected} (in the plain causal-LM form)"

    def _base(self, s: ast.stmt) -> None:
        target = s.targets[0] if isinstance(s, ast.Assign) and len(s.targets) == 1 else None
        if isinstance(s, ast.AnnAssign):
            target = s.target
        value = s.value if isinstance(s, ast.Assign | ast.AnnAssign) else None
        path = _self_path(value.func) if isinstance(value, ast.Call) else None
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Call) or not path:
            raise _Refused(f"its forward has no base model call before `{_line(s)}`")
        self.outputs, self.base = target.id, path
        args = []
        for arg in value.args:
            if not isinstance(arg, ast.Name) or arg.id not in self.params:
                raise _Refused(self._why(s, "a base model call with the forward's arguments"))
            args.append(arg.id)
        self.base_args = tuple(args)
        for keyword in value.keywords:
            v = keyword.value
            if keyword.arg is None and isinstance(v, ast.Name) and v.id == self.var_keyword:
                self.base_star = True
            elif keyword.arg is not None and isinstance(v, ast.Name) and v.id in self.params:
                self.base_kwargs.append((keyword.arg, v.id))
            elif keyword.arg is not None and isinstance(v, ast.Constant):
                if not isinstance(v.value, bool | int | str | type(None)):
                    raise _Refused(self._why(s, "a base model call"))
                self.base_constants.append((keyword.arg, v.value))
            else:
                raise _Refused(self._why(s, "a base model call with the forward's arguments"))
        self.step = "hidden"

    def _slice(self, text: str) -> bool:
        h = self.hidden
        if "logits_to_keep" not in self.params:
            return False
        if text == f"{h} = slice_logits_to_keep({h}, logits_to_keep)":
            return True
        m = re.fullmatch(
            rf"({_NAME}) = slice\(-logits_to_keep, None\) if isinstance\(logits_to_keep, "
            rf"int\) else logits_to_keep",
            text,
        )
        if m:
            self.slice_name = m[1]
        return m is not None

    def _head(self, s: ast.stmt, text: str) -> None:
        h = self.hidden
        argument = re.escape(f"{h}[:, {self.slice_name}, :]") if self.slice_name else h
        m = re.fullmatch(rf"({_NAME}) = self\.({_NAME})\({argument}\)(\.contiguous\(\))?", text)
        if not m:
            raise _Refused(self._why(s, "the head applied to the last hidden state"))
        self.logits, self.head, self.step = m[1], m[2], "softcap"

    def _softcap(self, s: ast.If) -> None:
        m = re.fullmatch(r"self\.config\.(\w+) is not None", ast.unparse(s.test))
        cap = m[1] if m else ""
        z = self.logits
        expected = [f"{z} = {z} / self.config.{cap}", f"{z} = torch.tanh({z})"]
        expected.append(f"{z} = {z} * self.config.{cap}")
        if not m or s.orelse or [ast.unparse(b) for b in s.body] != expected:
            raise _Refused(self._why(s, "a final logit softcap"))
        self.softcap, self.step = cap, "loss_none"

    def _loss(self, s: ast.stmt) -> None:
        body = s.body if isinstance(s, ast.If) and not s.orelse else []
        assign = body[0] if len(body) == 1 else None
        call = assign.value if isinstance(assign, ast.Assign) else None
        test = ast.unparse(s.test) if isinstance(s, ast.If) else ""
        if (
            test != "labels is not None"
            or "labels" not in self.params
            or not isinstance(assign, ast.Assign)
            or ast.unparse(assign.targets[0]) != "loss"
            or len(assign.targets) != 1
            or not isinstance(call, ast.Call)
            or ast.unparse(call.func) != "self.loss_function"
        ):
            shown = body[0] if body else s  # the statement under the `if`, if any
            raise _Refused(self._why(shown, "the loss (self.loss_function of the labels)"))
        expected = {"logits": self.logits, "labels": "labels", "vocab_size": "vocab"}
        given = dict(zip(expected, map(ast.unparse, call.args), strict=False))
        for keyword in call.keywords:
            if keyword.arg is None and ast.unparse(keyword.value) == self.var_keyword:
                self.loss_star = True
            elif keyword.arg in expected and keyword.arg not in given:
                given[keyword.arg] = ast.unparse(keyword.value)
            else:
                raise _Refused(self._why(assign, "the loss"))
        vocab = given.pop("vocab_size", "")
        expected.pop("vocab_size")
        if (
            given != expected
            or len(call.args) > 3
            or not re.fullmatch(r"self(\.\w+)*\.vocab_size", vocab)
        ):
            raise _Refused(self._why(assign, "the loss"))
        self.step = "tuple"

    def _return(self, s: ast.stmt) -> None:
        call = s.value if isinstance(s, ast.Return) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise _Refused(self._why(s, "the output"))
        fields, seen = [], set()
        for keyword in call.keywords:
            value, name = ast.unparse(keyword.value), keyword.arg
            m = re.fullmatch(rf"{self.outputs}\.(\w+)", value)
            if (name, value) in (("loss", "loss"), ("logits", self.logits)):
                seen.add(name)
            elif name is not None and m:
                fields.append((name, m[1]))
            else:
                raise _Refused(self._why(s, "the output"))
        if seen != {"loss", "logits"}:
            raise _Refused(self._why(s, "the output (with loss and logits)"))
        self.output, self.fields, self.step = call.func.id, tuple(fields), "done"


def _self_path(node: ast.expr) -> tuple[str, ...] | None:
    """``self.a.b`` as ``("a", "b")``; anything else ``None``."""
    path: list[str] = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id != "self" or not path:
        return None
    return tuple(reversed(path))
