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


# Tool-calling templates for synthetic models (`ingot model synth --template`): compact versions of Qwen 2.5's
# (Hermes-style: a system turn listing the tools as JSON inside <tools></tools>, calls answered as
# <tool_call>{"name", "arguments"}</tool_call>, results sent back as <tool_response> in a user turn) and of Llama
# 3.1's JSON tool calling (the tools as JSON in the first user turn, a call answered as {"name", "parameters"},
# results in an "ipython" turn). Each renders tools, tool calls and tool results as the original does.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" \
and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}\
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools and messages %}
{%- set first_user_message = messages[0]['content'] %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that \
best answers the given prompt.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\
Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or message.tool_calls) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable and message.content is not string %}\
{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

TOOL_TEMPLATES = {"chatml": CHATML_TEMPLATE, "hermes": HERMES_TEMPLATE, "llama3.1": LLAMA31_TEMPLATE}
