"""Reading a causal LM's forward into its plain form (tensorscope/fit/headform.py, pure): the
forms of transformers 4.x and 5.x, and the reason for anything else."""

from __future__ import annotations

import pytest

from tensorscope.fit.headform import HeadForm, read_head_form

# transformers 4.5x's LlamaForCausalLM.forward (line breaks moved)
LLAMA_4 = '''
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        cache_position=None,
        logits_to_keep=0,
        **kwargs,
    ):
        """Example: ..."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_position=cache_position,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        # Only compute necessary logits, and do not upcast them to float if we are not computing
        slice_indices = (
            slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        )
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
'''

# the form with keyword defaults from the config and a tuple branch (Falcon, Bloom; 4.4x)
TUPLE_BRANCH = """
def forward(self, input_ids=None, labels=None, output_attentions=None, return_dict=None,
            logits_to_keep=0, **kwargs):
    output_attentions = (
        output_attentions if output_attentions is not None else self.config.output_attentions
    )
    return_dict = return_dict if return_dict is not None else self.config.use_return_dict
    transformer_outputs = self.transformer(input_ids, output_attentions=output_attentions,
                                           return_dict=return_dict, use_cache=False)
    hidden_states = transformer_outputs[0]
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    lm_logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(lm_logits, labels, vocab_size=self.config.vocab_size, **kwargs)
    if not return_dict:
        output = (lm_logits,) + transformer_outputs[1:]
        return (loss,) + output if loss is not None else output
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=lm_logits,
                                             cache=transformer_outputs.cache)
"""

PLAIN_5 = """
def forward(self, input_ids=None, cache=None, labels=None, logits_to_keep=0, **kwargs):
    outputs = self.model(input_ids=input_ids, cache=cache, **kwargs)
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    if self.config.final_logit_softcapping is not None:
        logits = logits / self.config.final_logit_softcapping
        logits = torch.tanh(logits)
        logits = logits * self.config.final_logit_softcapping
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
"""


def test_the_4x_llama_form() -> None:
    form = read_head_form(LLAMA_4)
    assert isinstance(form, HeadForm)
    assert form.base == ("model",) and form.base_args == () and form.base_star
    assert ("past_key_values", "past_key_values") in form.base_kwargs
    assert form.sliced and form.head == "lm_head" and form.softcap is None and form.loss_star
    assert form.output == "CausalLMOutputWithPast" and not form.hidden_first
    assert dict(form.fields) == {
        "past_key_values": "past_key_values",
        "hidden_states": "hidden_states",
        "attentions": "attentions",
    }
    assert form.var_keyword == "kwargs" and form.tuple_branch is None


def test_config_defaults_and_a_tuple_branch() -> None:
    form = read_head_form(TUPLE_BRANCH)
    assert isinstance(form, HeadForm)
    assert form.config_defaults == (
        ("output_attentions", "output_attentions"),
        ("return_dict", "use_return_dict"),
    )
    assert form.base == ("transformer",) and form.base_args == ("input_ids",)
    assert form.base_kwargs == (
        ("output_attentions", "output_attentions"),
        ("return_dict", "return_dict"),
    )
    assert form.base_constants == (("use_cache", False),) and not form.base_star
    assert form.hidden_first and form.tuple_branch == "return_dict"
    assert form.fields == (("cache", "cache"),)


def test_a_softcap_and_positional_loss_arguments() -> None:
    form = read_head_form(PLAIN_5)
    assert isinstance(form, HeadForm)
    assert form.softcap == "final_logit_softcapping" and form.loss_star


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        # Mixtral: a router loss added to the loss
        (
            "    return CausalLMOutputWithPast(",
            "    loss += aux_loss\n    return X(",
            "loss += aux_loss",
        ),
        # Granite, Cohere: the logits scaled
        (
            "    loss = None\n",
            "    logits = logits * self.logit_scale\n    loss = None\n",
            "logit_scale",
        ),
        # 4.4x: an upcast before the loss
        ("    loss = None\n", "    logits = logits.float()\n    loss = None\n", "logits.float()"),
        # the head on something else than the hidden states
        ("self.lm_head(hidden_states)", "self.lm_head(hidden_states * 2)", "hidden_states * 2"),
        # a loss of the model's own making
        ("self.loss_function(logits, labels,", "my_loss(logits, labels,", "my_loss"),
        # another keyword to the loss
        ("self.vocab_size, **kwargs)", "self.vocab_size, weight=w)", "self.loss_function"),
        # the labels changed first
        ("    loss = None\n", "    labels = labels[:, 1:]\n    loss = None\n", "labels[:, 1:]"),
        # a softcap of another shape
        ("torch.tanh(logits)", "torch.tanh(logits) * 2", "final_logit_softcapping"),
        # an output field computed, not copied
        (
            "cache=outputs.cache)",
            "cache=outputs.cache, extra=logits.sum())",
            "CausalLMOutputWithPast",
        ),
        # the base model's argument computed
        ("input_ids=input_ids,", "input_ids=input_ids + 1,", "self.model"),
        # *args
        ("logits_to_keep=0, **kwargs", "logits_to_keep=0, *args, **kwargs", "*args"),
        # statements after the return
        ("outputs.cache)\n", "outputs.cache)\n    print(1)\n", "print(1)"),
    ],
)
def test_anything_else_is_a_reason_naming_it(old: str, new: str, named: str) -> None:
    assert old in PLAIN_5
    reason = read_head_form(PLAIN_5.replace(old, new, 1))
    assert isinstance(reason, str) and named in reason


def test_sources_that_are_not_one_function() -> None:
    assert "does not parse" in str(read_head_form("def forward(self:\n"))
    assert "not one function" in str(read_head_form("x = 1\n"))
    assert "ends before" in str(read_head_form(PLAIN_5.split("    loss = None")[0]))
