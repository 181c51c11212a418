"""Chat templates rendered as HF's apply_chat_template(add_generation_prompt=True) renders them, sandboxed."""

import dataclasses
from datetime import datetime

import pytest

from ingot.runtime.errors import ModelError, UsageError
from ingot.runtime.model.chat import chat_prompt, render
from ingot.runtime.model.templates import GEMMA_TEMPLATE, builtin_template
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
    v = tiny_tokenizer.vocab
    unknown_family = [t.replace("<|im_", "<|xx_") for t in v.tokens]  # no turn tokens a built-in template knows
    no_template = Tokenizer(dataclasses.replace(v, chat_template=None, tokens=unknown_family))
    with pytest.raises(ModelError, match="no chat template"):
        chat_prompt(no_template, USER)


# --- built-in templates for GGUFs without one (runtime/model/templates.py) -------------------------------


def _gemma_like(tiny_tokenizer) -> Tokenizer:
    """The tiny vocabulary plus Gemma's turn tokens (control tokens), and no template."""
    v = tiny_tokenizer.vocab
    tokens, types = [*v.tokens, "<start_of_turn>", "<end_of_turn>"], [*v.types, 3, 3]
    return Tokenizer(dataclasses.replace(v, tokens=tokens, types=types, chat_template=None, add_bos=True))


def test_gemma_vocabulary_without_template_gets_gemmas(tiny_tokenizer):
    tok = _gemma_like(tiny_tokenizer)
    assert builtin_template(tok.vocab)[0] == "gemma"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " What is 2+2? "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert render(GEMMA_TEMPLATE, messages, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = chat_prompt(tok, USER)
    start, end = tok.vocab.tokens.index("<start_of_turn>"), tok.vocab.tokens.index("<end_of_turn>")
    assert ids[0] == tok.vocab.bos_id and ids[1:].count(tok.vocab.bos_id) == 0  # BOS once, from the template
    assert ids.count(start) == 2 and ids.count(end) == 1
    assert end in tok.eog_ids  # generation stops at the end of the model's turn


def test_gemma_template_wants_alternating_roles(tiny_tokenizer):
    with pytest.raises(UsageError, match="must alternate"):
        chat_prompt(_gemma_like(tiny_tokenizer), USER + USER)


def test_chatml_vocabulary_without_template_gets_chatml(tiny_tokenizer):
    tok = Tokenizer(dataclasses.replace(tiny_tokenizer.vocab, chat_template=None))
    assert builtin_template(tok.vocab)[0] == "chatml"
    assert tok.decode(chat_prompt(tok, USER)) == "user\nWhat is 2+2?\nassistant\n"


def test_real_gemma3_chat_prompt(gemma3_tokenizer):
    ids = chat_prompt(gemma3_tokenizer, USER)
    # <bos> <start_of_turn> user \n ... <end_of_turn> \n <start_of_turn> model \n
    assert ids[:4] == [2, 105, 2364, 107] and ids[-5:] == [106, 107, 105, 4368, 107]
