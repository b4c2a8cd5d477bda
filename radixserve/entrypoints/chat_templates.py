"""Chat templates that `--chat-template` can name instead of giving a file (SGLang's names for
the conversation formats of the families served here), and the resolution of the flag: a file
of Jinja, one of these names, or an inline Jinja template (vLLM accepts one). A model whose
tokenizer has no template (a base model, a GGUF without one) serves chat requests with a named
one; one whose template is wrong for a fine-tune gets the right one without writing a file.

The templates take what transformers passes (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`); a message's content may be null (an assistant's tool calls), which renders empty.
"""

from __future__ import annotations

import os

# ChatML: SmolLM2, Qwen, and most instruct fine-tunes of small models.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen (1.5 and 2): ChatML whose conversation starts with a default system message.
QWEN = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + CHATML
)

# Llama 3 instruct: a header per message, each message ended by <|eot_id|>.
LLAMA_3_INSTRUCT = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- (message['content'] or '') | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# The system message of the [INST] formats below: taken off the messages, rendered by each.
_SYSTEM_FIRST = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] or '' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
)
_ALTERNATE = (
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('this chat template needs user and assistant messages alternating, "
    "starting with the user (after an optional system message)') }}"
    "{%- endif %}"
)

# Llama 2 chat: each exchange in its own <s>[INST] ... [/INST] ... </s>, the system message
# inside the first one.
LLAMA_2_CHAT = (
    _SYSTEM_FIRST
    + "{%- for message in turns %}"
    + _ALTERNATE
    + "{%- if message['role'] == 'user' %}"
    "{{- bos_token + '[INST] ' }}"
    "{%- if loop.first and system %}{{- '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{%- endif %}"
    "{{- (message['content'] or '') | trim + ' [/INST]' }}"
    "{%- else %}{{- ' ' + (message['content'] or '') | trim + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# Mistral instruct (v0.1/v0.2): one <s>, [INST] ... [/INST] per user turn, the system message
# before the first user message's text.
MISTRAL = (
    "{{- bos_token }}" + _SYSTEM_FIRST + "{%- for message in turns %}" + _ALTERNATE + "{%- if "
    "message['role'] == 'user' %}"
    "{{- '[INST] ' }}{%- if loop.first and system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- (message['content'] or '') + ' [/INST]' }}"
    "{%- else %}{{- (message['content'] or '') + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

NAMED_CHAT_TEMPLATES = {
    "chatml": CHATML,
    "qwen": QWEN,
    "llama-3-instruct": LLAMA_3_INSTRUCT,
    "llama-2-chat": LLAMA_2_CHAT,
    "mistral": MISTRAL,
}


def chat_template_source(value: str) -> str:
    """The Jinja source `--chat-template value` names: a file's contents, a named template, or
    `value` itself where it is a template (it has a Jinja tag). ValueError otherwise."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"--chat-template {value!r} cannot be read as UTF-8 text: {e}"
            ) from None
    if value in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r} is neither a file, nor a template name "
        f"({', '.join(NAMED_CHAT_TEMPLATES)}), nor a Jinja template"
    )
