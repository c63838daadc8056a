"""A base model's own chat template: conversations rendered with transformers' ``apply_chat_template``, and
the loss mask derived from the rendered text, so that it is right for any template.

The template is the model's (ChatML with Qwen3's ``<think>`` block, Llama 3's header ids, Gemma's turns);
nothing of it is re-written here. Which tokens are targets is found by rendering, not by knowing the
template. For each assistant message of a conversation:

- where its turn starts: the end of the conversation before it rendered with ``add_generation_prompt`` (what
  the model reads before it answers at generation time), when that is a prefix of the whole rendering.
  Everything from there is the model's to produce: Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` of the last
  turn included, as the template writes it. Otherwise (the turn's first message, or a template whose
  generation prompt differs from its history) where its content starts;
- where its content ends: the whole conversation rendered again with only this message's content replaced
  by a one-character probe; the two texts differ exactly where the content is, wherever the template puts it
  and however it transforms it (Llama 3 trims it, Qwen3 drops the reasoning of earlier turns);
- its end-of-turn token: the first special token after the content (``<|im_end|>``, ``<|eot_id|>``,
  ``<end_of_turn>``), with the whitespace-only tokens before it. The newline a template writes after it is
  not the model's to produce (generation stops at the token), so it is no target.

The rendered text is tokenized once (``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)``
does: the template writes its own BOS) with character offsets; a token is a target when it starts inside a
target span.

Prompts at generation time (``render_prompt``) and the choice between this and the plain template are in
``data/instructions.py``.
"""

from __future__ import annotations

from itertools import groupby

from scaletrain.data.tokenizer import DataError, HFTokenizer, Tokenizer

CHAT_TEMPLATE_CHOICES = ("auto", "base", "plain")
_PROBES = ("\ue000", "\ue001")  # private-use characters: never a template's own text


def uses_base_template(tokenizer: Tokenizer, choice: str) -> bool:
    """``finetune.chat_template``'s rule: 'plain' is always scaletrain's plain template; 'auto' (the default) the
    base's own template when its tokenizer folder has one, else the plain one; 'base' requires the base's (a
    DataError naming the file when it has none)."""
    if choice not in CHAT_TEMPLATE_CHOICES:
        raise DataError(f"finetune.chat_template must be one of {', '.join(CHAT_TEMPLATE_CHOICES)} (got {choice!r})")
    has = isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    if choice == "base" and not has:
        where = (tokenizer.folder / "tokenizer_config.json" if isinstance(tokenizer, HFTokenizer)
                 else getattr(tokenizer, "source", "") or "the base's tokenizer")
        raise DataError(f"finetune.chat_template = 'base' but {where} has no chat_template (nor a "
                        f"chat_template.jinja beside it); set finetune.chat_template = 'plain' to use scaletrain's "
                        f"plain template")
    return has and choice != "plain"


def render(hf, messages: list[dict], add_generation_prompt: bool = False, continue_final_message: bool = False) -> str:
    """The conversation as the template writes it (text, not ids). ``continue_final_message``: the last message
    is left open for the model to continue (lm-eval's few-shot answers, ``evaluation/lm_eval_model.py``)."""
    try:
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message)
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DataError(f"the chat template refuses this conversation: {why}") from None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _content_span(hf, messages: list[dict], index: int, text: str) -> tuple[int, int]:
    """[start, end) of message ``index``'s content in ``text`` (the whole conversation rendered): the region
    where ``text`` differs from the rendering with that content replaced by a probe character."""
    content = messages[index]["content"]
    probe = next(p for p in _PROBES if not content.startswith(p) and not content.endswith(p))
    other = render(hf, [dict(m, content=probe) if i == index else m for i, m in enumerate(messages)])
    start = _common_prefix(text, other)
    suffix = _common_prefix(text[::-1], other[::-1])
    suffix = min(suffix, len(text) - start, len(other) - start)
    return start, len(text) - suffix


def _turn_start(hf, messages: list[dict], index: int, text: str, content_start: int) -> int:
    """Where the model's part of assistant turn ``index`` starts: the end of the generation prompt after the
    conversation before it, when the whole rendering continues from there; else the content's start."""
    if index == 0:
        return content_start
    try:
        prompt = render(hf, messages[:index], add_generation_prompt=True)
    except DataError:  # a template that refuses the partial conversation: the content alone
        return content_start
    return len(prompt) if text.startswith(prompt) and len(prompt) <= content_start else content_start


def _special_ids(hf) -> set[int]:
    ids = {i for i, token in hf.added_tokens_decoder.items() if getattr(token, "special", False)}
    return ids | set(hf.all_special_ids)


def encode_conversation(messages: list[dict], hf) -> tuple[list[int], list[bool]]:
    """The conversation's token ids (``apply_chat_template(messages, tokenize=True)``'s) and, per id, whether it
    is a target: the assistant turns' contents and their end-of-turn tokens (see the module docstring)."""
    text = render(hf, messages)
    spans = []  # (turn start, content end) per assistant message, in characters of text
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            content_start, content_end = _content_span(hf, messages, index, text)
            spans.append((_turn_start(hf, messages, index, text, content_start), content_end))
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    special = _special_ids(hf)
    target = [False] * len(ids)
    for start, end in spans:
        inside = [i for i, (a, _) in enumerate(offsets) if start <= a < end]
        after = next((i for i, (a, _) in enumerate(offsets) if a >= end), len(ids))
        for i in inside:
            target[i] = True
        # the end-of-turn token: the first special token after the content, past whitespace-only tokens
        j = after
        while j < len(ids) and ids[j] not in special and not text[offsets[j][0]:offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in special:
            for i in range(after, j + 1):
                target[i] = True
    return ids, target


def mask_preview(ids: list[int], target: list[bool], decode) -> str:
    """The tokens of one example as text, each run of targets between ``[`` and ``]`` (``decode``: ids -> str)."""
    out = []
    for is_target, run in groupby(zip(ids, target), key=lambda pair: pair[1]):
        text = decode([token for token, _ in run])
        out.append(f"[{text}]" if is_target else text)
    return "".join(out)
