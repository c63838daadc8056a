"""The JSONL layouts of instruction data, told apart by a record's fields (no heavy imports: the text reader uses
this too, to say which flag reads a JSONL line that has no text field).

    prompt/response   {"prompt": str, "response": str}
    messages          {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
    Alpaca            {"instruction": str, "input": str (optional), "output": str}
    ShareGPT          {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}

prompt/response and messages are this project's own layout (one file may hold both); Alpaca (Taori et al. 2023,
tatsu-lab/stanford_alpaca) and ShareGPT are what instruction datasets on the Hugging Face Hub ship.
"""

from __future__ import annotations

# the layouts one file may mix: each of ours is one conversation written two ways
FAMILY = {"prompt/response": "ours", "messages": "ours", "Alpaca": "Alpaca", "ShareGPT": "ShareGPT"}


def instruction_layout(record: object) -> str | None:
    """The layout of one instruction record ('prompt/response', 'messages', 'Alpaca', 'ShareGPT'), judged from its
    fields in that order; None when it has none of them."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return "prompt/response"
    if isinstance(record.get("messages"), list) and record["messages"]:
        return "messages"
    if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        return "Alpaca"
    if isinstance(record.get("conversations"), list) and record["conversations"]:
        return "ShareGPT"
    return None


def fields_seen(record: object) -> str:
    """What a record holds, for a message: "fields: a, b" (or "no fields", "not a JSON object")."""
    if not isinstance(record, dict):
        return "not a JSON object"
    return f"fields: {', '.join(record)}" if record else "no fields"
