"""OpenAI Python SDK checks through Switchyard (run by sdk_test.go).

Usage: sdk_check.py BASE_URL MODEL. Prints one JSON object with what each
call returned; exits non-zero with the reason when a check fails.
"""

import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
out = {}


def check(cond, what):
    if not cond:
        print(json.dumps(out), flush=True)
        sys.exit("check failed: " + what)


c = client.completions.create(model=model, prompt="The SDK asks", max_tokens=8, temperature=0)
out["completion"] = c.choices[0].text
check(c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length", "completion usage/finish")

ch = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
)
out["chat"] = ch.choices[0].message.content
check(ch.choices[0].message.role == "assistant" and ch.usage.completion_tokens == 8, "chat role/usage")

text, usage = "", None
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "hello"}],
    max_tokens=8,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
    if chunk.usage:
        usage = chunk.usage
out["chat_stream"] = text
check(text == out["chat"], "streamed chat differs from the non-streamed one")
check(usage is not None and usage.completion_tokens == 8, "stream usage")

stext = "".join(
    ch.choices[0].text
    for ch in client.completions.create(model=model, prompt="The SDK asks", max_tokens=8, temperature=0, stream=True)
    if ch.choices
)
check(stext == out["completion"], "streamed completion differs")

try:
    client.completions.create(model=model, prompt="hi", max_tokens=5000)
    check(False, "max_tokens over the context accepted")
except openai.BadRequestError as e:
    out["bad_request"] = {"status": e.status_code, "message": e.message}
    check(e.status_code == 400 and "max_tokens" in str(e), "BadRequestError text")

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    check(False, "unknown model accepted")
except openai.NotFoundError as e:
    out["not_found"] = {"status": e.status_code}

models = client.models.list()
out["models"] = [m.id for m in models.data]
check(out["models"] == [model], "models list")
print(json.dumps(out), flush=True)
