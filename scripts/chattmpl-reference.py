"""Render chat templates with HuggingFace transformers' own Jinja setup
(apply_chat_template's environment: trim_blocks, lstrip_blocks, loop
controls, raise_exception) to produce the expectations of
internal/chattmpl's differential test.

    ~/.cache/switchyard-interop/venv/bin/python scripts/chattmpl-reference.py \
        > internal/chattmpl/testdata/reference.json
"""
import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}

TEMPLATES = {
    # scripts/make-tiny-model.py's template (the real-engine tier's model).
    "tiny": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    # Llama-3 style: bos_token, block tags on their own lines (trim_blocks,
    # lstrip_blocks), strip(), loop.first, a set.
    "llama3-like": """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
""",
    # ChatML with a default system turn and lstrip/trim-sensitive layout.
    "chatml": """{% for message in messages %}
  {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}""",
    # namespace, loop.last, raise_exception on a bad order, upper/replace.
    "alternating": """{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (ns.turns % 2 == 0) and message['role'] != 'system' %}
        {{- raise_exception('Conversation roles must alternate user/assistant') }}
    {%- endif %}
    {%- if message['role'] != 'system' %}{% set ns.turns = ns.turns + 1 %}{% endif %}
    {{- '[' ~ message['role']|upper ~ '] ' ~ message['content'].replace('  ', ' ') }}
    {%- if not loop.last %}{{ '\\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '\\n[ASSISTANT] ' }}{% endif %}""",
    # Qwen-like: iterates over a message's content parts, so vLLM passes
    # content as [{"type": "text", "text": ...}] (its "openai" content
    # format); the renderer does the same for such a template.
    "parts": """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}
{{- message.content }}
{%- else %}
{%- for part in message.content %}
{%- if part.type == 'text' %}{{ part.text }}{% endif %}
{%- if not loop.last %}{{ ' | ' }}{% endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}""",
}

# Templates given content as parts, as vLLM gives it to a template that
# iterates over content.
PARTS = {"parts"}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "line one\nline two\r\n  indented"},
        {"role": "assistant", "content": "Ünïcödé 😀 and \"quotes\" {{ not a tag }}"},
        {"role": "user", "content": "and\tthen?"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  "}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
]

out = []
for name, tmpl in TEMPLATES.items():
    for conv in CONVERSATIONS:
        for agp in (True, False):
            try:
                given = conv
                if name in PARTS:
                    given = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in conv]
                rendered, _ = render_jinja_template(
                    conversations=[given], chat_template=tmpl, add_generation_prompt=agp, **SPECIAL
                )
                want, err = rendered[0], None
            except Exception as e:  # the template raised
                want, err = None, str(e)
            out.append({"template": name, "messages": conv, "add_generation_prompt": agp, "want": want, "error": err})
json.dump({"special": SPECIAL, "templates": TEMPLATES, "parts": sorted(PARTS), "cases": out}, sys.stdout, indent=1, ensure_ascii=False)
sys.stdout.write("\n")
