"""A loaded run as an lm-evaluation-harness ``LM``: the run's model and tokenizer, scored as lm-eval's ``hf``
backend scores a Hugging Face model, so that both give the same numbers on the run and its HF export.

The ``hf`` backend's rules, restated only where our model and tokenizer need them (the arithmetic that is not
about the model — windows of a rolling log-likelihood, stop sequences, generation kwargs, batching order — is
lm-eval's own helpers):

- encoding: the tokenizer's ``encode`` with its special tokens (a Llama 3 tokenizer's BOS), unless the text already
  starts with the BOS (a chat template writes its own); a context that ends in spaces gives them to the
  continuation (``TemplateLM._encode_pair``);
- a text scored without context starts from the BOS token, else the EOS (``prefix_token_id``);
- context + continuation longer than the model's window (``model.max_seq_len``, the export's
  ``max_position_embeddings``): the last ``max_length + 1`` tokens are kept (truncated from the left);
- generation: greedy, at most ``max_gen_toks`` (default 256) new tokens, the context truncated from the left to
  ``max_length - max_gen_toks``; it stops at the end-of-text token or a stop sequence, which is cut off.

A char tokenizer has no unknown token: characters outside its vocabulary are left out (listed in ``skipped`` and
reported), as ``scaletrain eval --text`` does.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.data.chat import render
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, HFTokenizer, Tokenizer, encode_known
from scaletrain.model.generate import Sampling, generate_batch, stop_at_strings

DEFAULT_MAX_GEN_TOKS = 256  # the hf backend's ``max_gen_toks``


class ScaletrainLM(TemplateLM):
    """``model`` (a run read back by ``checkpoint.run.load_run``: any kind) with its ``tokenizer``.
    ``max_length``: the model's context window (``model.max_seq_len``); ``batch_size``: requests a forward."""

    backend = "causal"

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, max_length: int, batch_size: int = 8,
                 name: str = "scaletrain"):
        super().__init__()
        self.model = model
        self.tok = tokenizer  # not ``self.tokenizer``: lm-eval reads that attribute as a transformers tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.name = name
        self.vocab_limit = tokenizer.vocab_size  # a padded model's extra columns are not tokens
        self.skipped: set[str] = set()  # characters a char tokenizer lacks, left out of the texts
        self._device = next(model.parameters()).device

    # -- tokens ------------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What a text scored without context is conditioned on: the BOS, else the EOS (the hf backend's rule)."""
        prefix = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id
        if prefix is None:
            raise ConfigError("the run's tokenizer has neither a BOS nor an EOS token, which lm-eval puts before a "
                              "text scored without context (loglikelihood_rolling tasks such as wikitext); use "
                              "a run with a BPE tokenizer (data.tokenizer = 'bpe')")
        return prefix

    def token_text(self, token: int) -> str:
        """A token as text, special tokens included (transformers' ``decode(skip_special_tokens=False)``)."""
        if isinstance(self.tok, BPETokenizer):
            return self.tok.tok.id_to_token(token)
        return self.tok.decode([token])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if isinstance(self.tok, CharTokenizer):  # no special tokens to add; unknown characters left out
            ids, unknown = encode_known(self.tok, string)
            self.skipped.update(unknown)  # which characters, not how many: a text is encoded more than once
        else:
            if add_special_tokens is None:  # a text that already starts with the BOS (a chat template's) gets no other
                bos = self.tok.bos_id
                add_special_tokens = bos is None or not string.startswith(self.token_text(bos))
            ids = self.tok.encode(string) if add_special_tokens else self.tok.encode_text(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    # -- scoring -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request, in
        batches of similar length (longest first, as the hf backend orders them)."""
        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        too_long = next((r for r in requests if len(r[2]) > self.max_length), None)
        if too_long is not None:  # the hf backend stops at an assert here: no window holds the whole answer
            raise ConfigError(f"a continuation of {len(too_long[2])} tokens is longer than the model's context of "
                              f"{self.max_length} (model.max_seq_len), so it cannot be scored in one window; "
                              f"use a model with a longer context or a task with shorter answers")
        order = Collator(requests, sort_fn=longest_first)
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            # too long for the window: keep the last max_length + 1 tokens (the hf backend's left truncation)
            rows = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            logits = self._forward(rows)  # (B, L, V)
            for (request, _, continuation), row, row_logits in zip(chunk, rows, logits):
                start = len(row) - len(continuation)
                logprobs = row_logits[start:len(row), :self.vocab_limit].float().log_softmax(-1)  # (C, V)
                target = torch.tensor(continuation, device=logprobs.device)
                answer = (float(logprobs.gather(1, target[:, None]).sum()),
                          bool((logprobs.argmax(-1) == target).all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
        return order.get_original(results)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (B, L, V) of rows padded on the right (causal: no real token sees the padding)."""
        width = max(len(r) for r in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return self.model(batch.to(self._device))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood from the prefix token, in disjoint windows of the model's context
        (lm-eval's own window rule: every token scored once, the last window with a full context)."""
        windows, counts = [], []
        for (string,) in [request.args for request in requests]:
            pairs = [make_disjoint_window(pair) for pair in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, *pair) for pair in pairs]
            counts.append(len(pairs))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = []
        for request, count in zip(requests, counts):
            totals.append(sum(next(scores)[0] for _ in range(count)))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled where a task asks for ``do_sample``), cut at the first stop sequence."""
        eot = self.eot_token_id
        if eot is None:
            raise ConfigError(no_end_of_text(self.name))
        order = Collator([request.args for request in requests],
                         sort_fn=lambda args: (-len(args[0]), args[0]),  # longest first: batches of like length
                         group_by="gen_kwargs", group_fn=lambda args: args[1])
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], DEFAULT_MAX_GEN_TOKS)  # one group: the same kwargs
            until = handle_stop_sequences(kwargs.pop("until", None), eos=self.token_text(eot))
            max_new = kwargs.pop("max_gen_toks")
            room = self.max_length - max_new
            if room <= 0:
                raise ConfigError(f"a task asks for {max_new} new tokens, no fewer than the model's context of "
                                  f"{self.max_length}; set the task's generation_kwargs max_gen_toks lower")
            prompts = [self.tok_encode(context, left_truncate_len=room) for context in contexts]
            sampling = Sampling(temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0))
            new = generate_batch(self.model, prompts, max_new, max_seq_len=self.max_length, sampling=sampling,
                                 generator=torch.Generator().manual_seed(1234), stop_id=eot,
                                 vocab_limit=self.vocab_limit, stop=stop_at_strings(self.tok.decode, until))
            for context, gen_kwargs, tokens in zip(contexts, all_kwargs, new):
                text = postprocess_generated_text(self.tok.decode(tokens), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return order.get_original(results)

    # -- chat ----------------------------------------------------------------------------------------------------
    def _chat_tokenizer(self):
        """transformers' tokenizer of the base the run came from, when that base brings a chat template."""
        if not (isinstance(self.tok, HFTokenizer) and self.tok.has_chat_template):
            raise ConfigError(no_chat_template(self.name))
        return self.tok.transformers_tokenizer()

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The few-shot conversation in the base's own chat template (rendered by transformers, as the hf backend
        does); ``add_generation_prompt=False``: the last (assistant) message is continued."""
        return render(self._chat_tokenizer(), chat_history, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self._chat_tokenizer().chat_template

    @property
    def tokenizer_name(self) -> str:
        return self.name


def no_end_of_text(run: str) -> str:
    """The refusal of a generate_until task for a tokenizer without an end-of-text token."""
    return (f"{run}: its tokenizer has no end-of-text token (a char tokenizer has none), so a generate_until task "
            f"cannot know where an answer ends; use a run with a BPE tokenizer (data.tokenizer = 'bpe') or "
            f"multiple-choice tasks")


def no_chat_template(run: str) -> str:
    """The refusal of --apply-chat-template for a run whose tokenizer brings no chat template."""
    return (f"{run}: --apply-chat-template needs the chat template of a Hugging Face base, and this run's "
            f"tokenizer has none (a run fine-tuned from such a base keeps it); drop --apply-chat-template")
