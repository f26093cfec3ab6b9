"""Chat templates (Jinja) shipped with the tiny checkpoints.

Both accept OpenAI-style messages whose ``content`` is a string, ``None`` or a list of
parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {...}}``
or the HF-style ``{"type": "image", ...}``. Every image part renders as exactly one
``<image>`` placeholder at the position of the part (the processor later expands it to
the image's token count); nothing else is inserted around it.
"""

from __future__ import annotations

_RENDER_CONTENT = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url', 'input_image'] -%}<image>"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

# LLaVA-1.5 (Vicuna) style: "<s>USER: <image>\nWhat is this? ASSISTANT:"
LLAVA_CHAT_TEMPLATE = _RENDER_CONTENT + (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ render_content(message['content']) }}{{ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}USER: {{ render_content(message['content']) }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "ASSISTANT: {{ render_content(message['content']) }}{{ eos_token }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}"
)

# Qwen2 chatml style (FastVLM's language model is Qwen2).
CHATML_CHAT_TEMPLATE = _RENDER_CONTENT + (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}{{ render_content(message['content']) }}<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)
