"""Built-in chat templates for GGUFs that carry none (`tokenizer.chat_template` absent), as llama.cpp falls back
to a built-in template for known families (llama-chat.cpp).

The family is recognised from the vocabulary's turn tokens, not from the architecture name, since one
architecture hosts several chat formats and a base model's vocabulary still has its family's turn tokens:

  - Gemma (`<start_of_turn>` and `<end_of_turn>`): `<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n`,
    the assistant's role written as "model", a system message prepended to the first user turn (Gemma has no
    system role), BOS from the template; generation stops on `<end_of_turn>` (an end-of-generation token).
  - ChatML (`<|im_start|>` and `<|im_end|>`): Qwen, SmolLM and others.

The texts follow the templates these families ship in their tokenizer_config.json (text content only).
"""

from __future__ import annotations

from ingot.runtime.model.gguf import Vocab

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# (name, tokens the vocabulary must have, template), checked in order.
BUILTIN_TEMPLATES = (
    ("gemma", ("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE),
    ("chatml", ("<|im_start|>", "<|im_end|>"), CHATML_TEMPLATE),
)


def builtin_template(vocab: Vocab) -> tuple[str, str] | None:
    """(family name, template) of the built-in template for a vocabulary without its own, or None."""
    tokens = set(vocab.tokens)
    for name, needs, template in BUILTIN_TEMPLATES:
        if all(t in tokens for t in needs):
            return name, template
    return None


def chat_template(vocab: Vocab) -> str | None:
    """The template to render a conversation with: the GGUF's own, else a built-in one, else None."""
    if vocab.chat_template:
        return vocab.chat_template
    builtin = builtin_template(vocab)
    return builtin[1] if builtin else None
