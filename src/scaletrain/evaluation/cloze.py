"""gutenberg-cloze: a four-way multiple-choice cloze built from a run's held-out text, so that a run trained on
books has a benchmark that needs no network and that no step of its training has seen.

How an item is built (deterministic: the same prepared data gives the same task, byte for byte):

- **Text**: the run's validation split as ``prepare`` wrote it (``data/run_data.py``'s prepared folder, split
  ``val``: whole held-out books in a document split, the tail of each book in a tail split), decoded document by
  document with the run's tokenizer, the first ``MAX_TEXT_CHARS`` characters at most.
- **Sentences**: a sentence ends at ``.``, ``!`` or ``?`` (closing quotes and brackets kept with it) followed by
  whitespace, or at a blank line (a verse speech or a heading ends there too). Whitespace inside a sentence is
  collapsed to one space, so line breaks are no clue.
- **Passage**: the ``PASSAGE_SENTENCES`` (3) sentences before the answer, in the same document and not its first
  (which a tail split may have cut in the middle); the answer is
  the sentence that follows them, and only sentences of ``MIN_CHARS``-``MAX_CHARS`` (20-100) characters are
  answers or distractors (an answer must fit the window of a char model: the default run's is 128 characters).
- **Distractors**: three distinct sentences from elsewhere in the held-out text: not within ``NEIGHBOURHOOD`` (20)
  sentences of the answer in its document, not equal to it, and next to it in length: ``acc`` picks the choice with
  the highest total log-likelihood, which favours short sentences, so the answer's length rank among the four is
  drawn uniformly (0-3 distractors shorter than it, from its ``NEAREST`` (10) nearest neighbours in length below,
  the rest from the 10 above). A choice made by length alone is right 25% of the time; what is left to tell them
  apart is what the passage says: who speaks, about what, in which register.
- **Order**: the answer's position among the four is drawn from a seeded ``random.Random(SEED)``, as are the
  distractors; chance is 25%. At most ``MAX_ITEMS`` (500) items, spread evenly over the candidate answers.

The task is written as lm-eval's own YAML over a JSONL file (``dataset_path: json``) into the prepared data
folder (``<data>/gutenberg-cloze/``, rebuilt when the data or this recipe changes) and run by lm-eval's
evaluator like any other task: ``acc`` (the choice with the highest log-likelihood) and ``acc_norm`` (log-
likelihood per character of the choice).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np

from scaletrain.core.files import guarded_write
from scaletrain.data.loader import TokenStream
from scaletrain.data.shards import read_manifest
from scaletrain.data.tokenizer import DataError, Tokenizer

TASK = "gutenberg-cloze"
VERSION = 2  # bump when an item changes for the same data: the cached task is rebuilt
SEED = 1234
PASSAGE_SENTENCES = 3
MIN_CHARS, MAX_CHARS = 20, 100
NEIGHBOURHOOD = 20
NEAREST = 10
MAX_ITEMS = 500
MAX_TEXT_CHARS = 5_000_000
CHOICES = 4

# A sentence ends after . ! ? (and the quotes or brackets closing it) before whitespace, or at a blank line.
_BOUNDARY = re.compile(r"(?<=[.!?])[\"'\u2019\u201d)\]]*\s+|\n\s*\n")

YAML = """\
# gutenberg-cloze: built by scaletrain (evaluation/cloze.py) from the run's held-out text; chance is 25%.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` (see the module docstring), whitespace collapsed, empty ones dropped."""
    pieces = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        pieces.append(text[start:match.start() + len(match.group(0).rstrip())])
        start = match.end()
    pieces.append(text[start:])
    return [s for s in (" ".join(p.split()) for p in pieces) if s]


def _answer_positions(documents: list[list[str]]) -> list[tuple[int, int]]:
    """(document, sentence) of every sentence that can be an answer: long enough, with a whole passage before it
    that leaves out the document's first sentence (a tail split cuts a book mid-sentence)."""
    return [(d, i) for d, sentences in enumerate(documents) for i in range(PASSAGE_SENTENCES + 1, len(sentences))
            if MIN_CHARS <= len(sentences[i]) <= MAX_CHARS]


def _distractors(pool: list[tuple[int, int, int, str]], position: int, rng: random.Random) -> list[str]:
    """Three sentences from away from the answer ``pool[position]`` (``pool``: (length, document, index, text) of
    every candidate sentence, sorted by length): ``shorter`` of them among its ``NEAREST`` neighbours in length
    below it and the rest among those above, ``shorter`` drawn uniformly from 0-3, so that the answer's length
    rank among the four is uniform and a choice made by length alone is right a quarter of the time."""
    _, doc, index, text = pool[position]

    def allowed(entries) -> list[str]:
        return list(dict.fromkeys(e[3] for e in entries
                                  if e[3] != text and not (e[1] == doc and abs(e[2] - index) <= NEIGHBOURHOOD)))

    below = allowed(reversed(pool[max(0, position - 4 * NEAREST):position]))[:NEAREST]  # nearest first
    above = allowed(pool[position + 1:position + 1 + 4 * NEAREST])[:NEAREST]
    above = [t for t in above if t not in below]
    shorter = rng.randrange(CHOICES)
    shorter = min(max(shorter, CHOICES - 1 - len(above)), len(below))  # at the ends of the pool: what there is
    if shorter + len(above) < CHOICES - 1:
        raise DataError(f"{TASK}: the held-out text has too few sentences for distractors")
    return rng.sample(below, shorter) + rng.sample(above, CHOICES - 1 - shorter)


def build_items(texts: list[str], max_items: int = MAX_ITEMS, seed: int = SEED) -> list[dict]:
    """The task's items from held-out documents: {"passage", "choices" (4), "label" (the answer's index)}."""
    documents = [split_sentences(text) for text in texts]
    positions = _answer_positions(documents)
    if not positions:
        raise DataError(f"{TASK}: the held-out text has no sentence of {MIN_CHARS}-{MAX_CHARS} characters after "
                        f"{PASSAGE_SENTENCES} others; the run's validation split is too small (data.val_fraction)")
    pool = sorted((len(documents[d][i]), d, i, documents[d][i]) for d, i in positions)
    where = {(entry[1], entry[2]): k for k, entry in enumerate(pool)}
    picks = np.linspace(0, len(positions) - 1, min(max_items, len(positions))).round().astype(int)
    rng = random.Random(seed)
    items = []
    for pick in dict.fromkeys(picks.tolist()):
        d, i = positions[pick]
        answer = documents[d][i]
        choices = _distractors(pool, where[d, i], rng)
        label = rng.randrange(CHOICES)
        choices.insert(label, answer)
        items.append({"passage": " ".join(documents[d][i - PASSAGE_SENTENCES:i]), "choices": choices,
                      "label": label})
    return items


def held_out_texts(data_dir: Path, tokenizer: Tokenizer, max_chars: int = MAX_TEXT_CHARS) -> list[str]:
    """The validation split of a prepared folder as text, one string a document (the first ``max_chars``)."""
    stream = TokenStream(str(data_dir), "val")
    if stream.total == 0:
        raise DataError(f"{data_dir}: the validation split is empty; {TASK} is built from it (data.val_fraction)")
    ends = stream.doc_ends.tolist() if stream.doc_ends is not None else [stream.total]
    texts, start, chars = [], 0, 0
    for end in ends:
        text = tokenizer.decode(stream.read(start, end - start).tolist())
        texts.append(text)
        chars += len(text)
        start = end
        if chars >= max_chars:
            break
    return texts


def cloze_task_folder(data_dir: Path, tokenizer: Tokenizer, say=print) -> Path:
    """The folder holding gutenberg-cloze's YAML and JSONL for the prepared data in ``data_dir`` (an
    ``--include-path`` for lm-eval), built once and reused while the data and ``VERSION`` are the same."""
    folder = data_dir / TASK
    manifest = read_manifest(data_dir, verify=False)
    key = {"version": VERSION, "val": [s["sha256"] for s in manifest["splits"]["val"]["shards"]]}
    record = folder / "build.json"
    if record.is_file() and json.loads(record.read_text()) == key:
        return folder
    items = build_items(held_out_texts(data_dir, tokenizer))
    with guarded_write(f"the {TASK} task", folder):
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / f"{TASK}.jsonl"
        data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
        (folder / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=json.dumps(str(data.resolve())),
                                                         version=VERSION))
        record.write_text(json.dumps(key))
    say(f"{TASK}: built {len(items)} items from the held-out split of {data_dir} into {folder}")
    return folder
