"""Talk to `scaletrain serve` with the official `openai` client, unchanged: python openai_client.py URL."""

import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")  # any key when the server was started without one
model = client.models.list().data[0].id
answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who goes there?"}],
                                        max_tokens=30, temperature=0)
print("chat:", repr(answer.choices[0].message.content), answer.usage)
print("stream: ", end="")
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Good morrow"}],
                                            max_tokens=30, stream=True):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
print("completion:", repr(client.completions.create(model=model, prompt="ROMEO:", max_tokens=20).choices[0].text))
