"""Preference data for DPO, SimPO and ORPO (``finetune.preferences``): JSONL pairs of a preferred and a
dispreferred completion of one prompt.

Accepted lines (one JSON object per line, blank lines skipped)::

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...], "chosen": "...", "rejected": "..."}

Each completion is rendered after its prompt exactly as an instruction example is (data/instructions.py: the
base's chat template, or our plain one, chosen by ``finetune.chat_template``): ``{"prompt": p, "response":
chosen}``, or the messages followed by an assistant turn holding it. Only the completion's tokens (and its
end-of-turn token) are targets: earlier assistant turns of ``messages`` are context, not scored.

A pair is one example of two padded rows: the chosen row and the rejected row. A micro-batch of B pairs is
(2B, T): the B chosen rows, then the B rejected rows (TRL's ``concatenated_forward`` order), so both
completions of every pair go through one forward.

Refused with one line naming the file and line (a DataError, exit 2): a missing or non-string field, an empty
``chosen`` or ``rejected``, the two identical (the pair teaches nothing), and a pair whose prompt plus either
completion is longer than data.seq_len + 1 tokens. Such a pair is *refused, not cut*: a cut completion is a
different text, and the chosen and rejected rows would no longer be compared on what the data says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from scaletrain.data.chat import uses_base_template
from scaletrain.data.instructions import InstructionLoader, encode_record, jsonl_records, make_rows, split_examples
from scaletrain.data.tokenizer import DataError, Tokenizer

# A pair: ((chosen ids, chosen is_target), (rejected ids, rejected is_target)), numpy arrays.
Pair = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _last_turn_only(target: np.ndarray) -> np.ndarray:
    """``target`` with only its last run of targets kept: the completion (and its end-of-turn token), not the
    assistant turns of the context before it."""
    positions = np.flatnonzero(target)
    if len(positions) == 0:
        return target
    gaps = np.flatnonzero(np.diff(positions) > 1)
    start = positions[gaps[-1] + 1] if len(gaps) else positions[0]
    kept = np.zeros_like(target)
    kept[start:] = target[start:]
    return kept


def _completion_record(record: dict, completion: str, where: str) -> dict:
    """The instruction record (data/instructions.py) of the prompt followed by ``completion``."""
    if isinstance(record.get("prompt"), str):
        return {"prompt": record["prompt"], "response": completion}
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        return {"messages": messages + [{"role": "assistant", "content": completion}]}
    raise DataError(f"{where}: needs a 'prompt' string or a 'messages' list, and string fields 'chosen' and "
                    f"'rejected'")


def encode_pair(record: object, where: str, tokenizer: Tokenizer, hf, seq_len: int) -> Pair:
    """One JSONL record as a pair of (ids, is_target) arrays, checked (module docstring)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object")
    for field in ("chosen", "rejected"):
        if field not in record:
            raise DataError(f"{where}: missing field '{field}' (each line needs 'chosen' and 'rejected' "
                            f"completions of its 'prompt' or 'messages')")
        if not isinstance(record[field], str):
            raise DataError(f"{where}: '{field}' must be a string (got {type(record[field]).__name__})")
        if not record[field].strip():
            raise DataError(f"{where}: '{field}' is empty; a pair needs two non-empty completions")
    if record["chosen"] == record["rejected"]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical; the pair teaches nothing, drop it")
    pair = []
    for field in ("chosen", "rejected"):
        ids, target = encode_record(_completion_record(record, record[field], where), where, tokenizer, hf)
        if len(ids) > seq_len + 1:
            raise DataError(f"{where}: the prompt and its '{field}' completion are {len(ids)} tokens, longer than "
                            f"data.seq_len + 1 = {seq_len + 1}; pairs are refused, not cut (a cut completion is "
                            f"another text): raise data.seq_len or shorten the pair")
        pair.append((ids, _last_turn_only(target)))
    return pair[0], pair[1]


def read_preferences(path: str | Path, tokenizer: Tokenizer, seq_len: int, chat_template: str = "auto") -> list[Pair]:
    """Every pair of a preference JSONL file, in the template ``chat_template`` chooses; a bad line is a
    DataError naming the file and line number."""
    hf = tokenizer.transformers_tokenizer() if uses_base_template(tokenizer, chat_template) else None
    pairs = [encode_pair(record, where, tokenizer, hf, seq_len)
             for where, record in jsonl_records(path, "finetune.preferences")]
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def preference_splits(path: str | Path, tokenizer: Tokenizer, seq_len: int, val_fraction: float, seed: int,
                      chat_template: str = "auto") -> tuple[list[Pair], list[Pair]]:
    """(train, val) pairs of a preference file: a deterministic ``val_fraction`` held out (the same rule as
    instruction examples, ``split_examples``)."""
    pairs = read_preferences(path, tokenizer, seq_len, chat_template)
    train, val = split_examples(pairs, val_fraction, seed)
    if not val:
        raise DataError(f"{path}: {len(pairs)} pair(s) leave none for validation; add pairs or set "
                        f"data.val_fraction > 0")
    return train, val


def pair_rows(pairs: list[Pair], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen inputs, chosen targets, rejected inputs, rejected targets), each (N, seq_len)."""
    chosen = make_rows([p[0] for p in pairs], seq_len)
    rejected = make_rows([p[1] for p in pairs], seq_len)
    return chosen[0], chosen[1], rejected[0], rejected[1]


class PreferenceLoader(InstructionLoader):
    """``InstructionLoader`` over pairs: the same order, resume state and per-rank slices, each batch of B pairs
    given as (2B, T) rows, chosen then rejected."""

    def __init__(self, pairs: list[Pair], seq_len: int, batch_size: int, **kwargs):
        super().__init__([p[0] for p in pairs], seq_len, batch_size, **kwargs)
        self.rejected_inputs, self.rejected_targets = make_rows([p[1] for p in pairs], seq_len)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self._next_rows()
        return (torch.cat([self.inputs[mine], self.rejected_inputs[mine]]),
                torch.cat([self.targets[mine], self.rejected_targets[mine]]))


def preference_eval_batches(pairs: list[Pair], seq_len: int, batch_size: int, num_batches: int):
    """The first ``num_batches`` batches of held-out pairs (all when <= 0), in file order, as (2B, T) rows."""
    ci, ct, ri, rt = pair_rows(pairs, seq_len)
    n = len(ci) if num_batches <= 0 else min(len(ci), num_batches * batch_size)
    for i in range(0, n, batch_size):
        j = min(i + batch_size, n)
        yield torch.cat([ci[i:j], ri[i:j]]), torch.cat([ct[i:j], rt[i:j]])
