"""Chat templates rendered as HF's apply_chat_template(add_generation_prompt=True) renders them, sandboxed."""

import dataclasses
from datetime import datetime

import pytest

from ingot.runtime.errors import ModelError, UsageError
from ingot.runtime.model.chat import chat_prompt, render
from ingot.runtime.model.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is 2+2?"}]


def test_smollm2_template_adds_its_default_system_prompt(real_model):
    text = render(real_model.vocab.chat_template, USER)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_template_keeps_a_given_system_prompt(real_model):
    messages = (
        [{"role": "system", "content": "Be brief."}]
        + USER
        + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    )
    text = render(real_model.vocab.chat_template, messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )


def test_chat_prompt_tokens_use_the_control_tokens(real_tokenizer):
    ids = chat_prompt(real_tokenizer, USER)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2
    assert real_tokenizer.decode(ids).endswith("What is 2+2?\nassistant\n")


def test_bos_is_added_once(tiny_tokenizer):
    vocab = dataclasses.replace(
        tiny_tokenizer.vocab, add_bos=True, chat_template="{{ bos_token }}{{ messages[0]['content'] }}"
    )
    with_bos_in_template = chat_prompt(Tokenizer(vocab), USER)
    assert with_bos_in_template[0] == 1 and with_bos_in_template[1] != 1
    vocab = dataclasses.replace(vocab, chat_template="{{ messages[0]['content'] }}")
    assert chat_prompt(Tokenizer(vocab), USER)[0] == 1


def test_environment_matches_transformers():
    # trim_blocks + lstrip_blocks: block tags leave no blank lines or indentation behind
    template = "{% for m in messages %}\n  {% if m.content %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}"
    assert render(template, USER) == "What is 2+2?\n"
    # tojson keeps non-ASCII text, as transformers' does
    assert (
        render("{{ messages[0] | tojson }}", [{"role": "user", "content": "héllo"}])
        == '{"role": "user", "content": "héllo"}'
    )
    assert render("{{ strftime_now('%Y') }}", USER) == str(datetime.now().year)
    assert render("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", USER) == "1"
    assert render("{% generation %}ok{% endgeneration %}", USER) == "ok"
    assert render("{{ bos_token }}|{{ eos_token }}", USER, bos_token="<s>", eos_token="</s>") == "<s>|</s>"
    assert render("{% if add_generation_prompt %}go{% endif %}", USER) == "go"


def test_raise_exception_is_a_usage_error():
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    with pytest.raises(UsageError, match="need a system message"):
        render(template, USER)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # reaching Python internals
        "{% set xs = [] %}{{ xs.append(1) }}",  # mutating (immutable sandbox)
    ],
)
def test_sandbox_blocks_unsafe_templates(template):
    with pytest.raises(ModelError, match="unsafe"):
        render(template, USER)


def test_broken_templates_are_model_errors(tiny_tokenizer):
    with pytest.raises(ModelError, match="does not parse"):
        render("{% for m in messages %}", USER)
    no_template = Tokenizer(dataclasses.replace(tiny_tokenizer.vocab, chat_template=None))
    with pytest.raises(ModelError, match="no chat template"):
        chat_prompt(no_template, USER)
