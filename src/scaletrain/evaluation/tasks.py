"""``scaletrain eval --run R --tasks T1,T2``: a run on lm-evaluation-harness tasks, through lm-eval's own
``simple_evaluate`` (its task configs, few-shot sampling, filters, metrics and aggregation; only the model is
ours: ``evaluation/lm_eval_model.py``).

Before anything is scored, every refusal is one line (exit 2): an unknown task (with the close names), a task
whose data must be downloaded on a machine without network (with the local route, ``--include-path``), a
generate_until task for a tokenizer without an end-of-text token, a rolling log-likelihood task for one without
a BOS or EOS, ``--limit`` < 1, ``--num-fewshot`` < 0 or above the task's few-shot examples; and a local task's
YAML that is not UTF-8 or not YAML, a data file that is not there, a JSONL line that is not an object, a template
naming a field the rows lack, a label outside its choices (each naming the YAML or the data file and row).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.core.files import write_file
from scaletrain.core.options import ConfigError
from scaletrain.data.sources import hub_reachable

LOCAL_ROUTE = ("give a local copy as a task YAML with dataset_path: json and dataset_kwargs: {data_files: ...} in a "
               "folder passed with --include-path (docs/evaluation.md)")


@dataclass
class TaskRequest:
    """What ``scaletrain eval --tasks`` was asked for."""

    run: str
    tasks: list[str]
    limit: int | None = None
    num_fewshot: int | None = None
    include_path: str | None = None
    json_path: str | None = None
    apply_chat_template: bool = False
    batch_size: int = 8
    device: str = "auto"  # the GPU when there is one
    log_samples: str | None = None  # the JSONL of every sample's requests and responses (``samples_path``)

    def check(self) -> None:
        """The arguments alone (before the run or lm-eval is loaded)."""
        if not self.tasks or any(not name for name in self.tasks):
            raise ConfigError(f"--tasks: give task names separated by commas (got {','.join(self.tasks)!r})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1 (samples per task; got {self.limit}); leave it out to score "
                              f"every sample")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"--num-fewshot must be >= 0 (got {self.num_fewshot}); leave it out for each task's "
                              f"own default")
        if self.include_path and not Path(self.include_path).is_dir():
            raise ConfigError(f"--include-path {self.include_path}: not a folder (give the folder holding the task "
                              f"YAML files)")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1 (got {self.batch_size})")


def task_request(args) -> TaskRequest | None:
    """``scaletrain eval``'s arguments as a TaskRequest when --tasks is given; None otherwise, after checking that
    no flag of --tasks stands alone (it would be ignored) and that --tasks comes without --text / --batches."""
    if not args.tasks:
        alone = [flag for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                          ("--include-path", args.include_path),
                                          ("--apply-chat-template", args.apply_chat_template or None),
                                          ("--log-samples", args.log_samples))
                 if value is not None]
        if alone:
            raise ConfigError(f"{', '.join(alone)}: only with --tasks (lm-evaluation-harness tasks)")
        return None
    if args.text or args.batches is not None:
        raise ConfigError("--text and --batches score a text or the val split, --tasks benchmark tasks: give one "
                          "or the other")
    return TaskRequest(args.run, [name.strip() for name in args.tasks.split(",")], args.limit, args.num_fewshot,
                       args.include_path, args.json, args.apply_chat_template, args.batch_size,
                       log_samples=samples_path(args.log_samples, args.json))


def samples_path(given: str | None, json_path: str | None) -> str | None:
    """Where ``--log-samples`` writes: its own path, else beside ``--json`` (``scores.json`` ->
    ``scores.samples.jsonl``); None when not asked. Refused in one line with neither."""
    if given is None:
        return None
    if given:
        return given
    if not json_path:
        raise ConfigError("--log-samples: give it a file (--log-samples samples.jsonl) or give --json FILE, beside "
                          "which it writes FILE.samples.jsonl")
    path = Path(json_path)
    return str(path.with_name(path.stem + ".samples.jsonl"))


def import_lm_eval():
    """lm-eval's evaluator and task manager, or a one-line ConfigError saying what to install."""
    try:
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("--tasks runs lm-evaluation-harness, which is not installed: pip install "
                          "'scaletrain[eval]'") from None
    return evaluator, TaskManager


def unknown_task(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (f"--tasks: unknown task {name!r}{hint}; `lm-eval ls tasks` lists lm-eval's, gutenberg-cloze is "
            f"scaletrain's, and --include-path adds a folder of your own task YAMLs")


def is_network_failure(exc: BaseException) -> bool:
    """Whether loading a task failed for want of the network (the Hub unreachable, or offline mode)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, ConnectionError) or any(s in text for s in (
        "offline", "couldn't reach", "connection", "name or service not known", "localentrynotfound",
        "max retries exceeded"))


def load_tasks(task_manager, names: list[str], online: bool) -> dict:
    """lm-eval's loaded tasks (datasets read) for ``names``; a download that cannot happen, and a local task whose
    data or templates are wrong (``task_problem``), are one line."""
    try:
        return task_manager.load(names)
    except Exception as exc:  # datasets / huggingface_hub raise many types for a missing network
        if not online and is_network_failure(exc):
            raise ConfigError(f"--tasks {','.join(names)}: a task's data is not on this machine and it has no "
                              f"network to download it ({str(exc).splitlines()[0][:120]}); run it where the Hugging "
                              f"Face Hub is reachable, or {LOCAL_ROUTE}") from None
        problem = task_problem(task_manager, names, exc)
        if problem is None:
            raise
        raise ConfigError(problem) from None


def task_problem(task_manager, names: list[str], exc: BaseException) -> str | None:
    """The one line for a task that failed to load for a reason in its YAML or its local data (None for any
    other failure): a data file that is not there, a JSONL line that is not a JSON object, a template naming a
    field the rows do not have."""
    import jinja2

    name = _failing_task(task_manager, names)
    entry = task_manager.task_index.get(name)
    yaml_path = getattr(entry, "yaml_path", None)
    where = f"--tasks {name} ({yaml_path})" if yaml_path else f"--tasks {name}"
    files = _data_files(yaml_path)
    if isinstance(exc, FileNotFoundError):
        missing = [f for f in files if not Path(f).is_file()] or [str(exc)]
        return (f"{where}: data file {missing[0]} not found (dataset_kwargs.data_files; a relative path is read "
                f"from the folder you run in, {Path.cwd()})")
    if isinstance(exc, jinja2.TemplateError):
        fields = _first_row_fields(files)
        seen = f" (its rows have: {', '.join(fields)})" if fields else ""
        return f"{where}: a template (doc_to_text / doc_to_target / doc_to_choice) fails: {exc}{seen}"
    if type(exc).__name__ == "DatasetGenerationError":
        for file in files:
            bad = _bad_jsonl_line(file)
            if bad is not None:
                return f"{where}: {file}:{bad[0]}: {bad[1]}; each line must be one JSON object"
        cause = exc.__cause__ or exc.__context__
        return f"{where}: its data could not be read ({cause or exc})"
    return None


def _failing_task(task_manager, names: list[str]) -> str:
    """Which of ``names`` fails to load (each loaded alone: the error does not say)."""
    for name in names[:-1]:
        try:
            task_manager.load([name])
        except Exception:
            return name
    return names[-1]


def _data_files(yaml_path) -> list[str]:
    """The local files a task YAML names in ``dataset_kwargs.data_files`` (a path, a list, or split -> paths)."""
    config = read_task_yaml(Path(yaml_path)) if yaml_path else {}
    files = ((config or {}).get("dataset_kwargs") or {}).get("data_files") or []
    values = files.values() if isinstance(files, dict) else [files]
    return [str(f) for value in values for f in (value if isinstance(value, list) else [value])]


def _first_row_fields(files: list[str]) -> list[str]:
    for file in files:
        try:
            with open(file, encoding="utf-8") as fh:
                row = json.loads(fh.readline())
        except (OSError, ValueError):
            continue
        if isinstance(row, dict):
            return list(row)
    return []


def _bad_jsonl_line(file: str) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first line of a JSONL file that is not a JSON object."""
    from scaletrain.data.prepare import read_text_file

    try:
        text = read_text_file(Path(file))
    except Exception as exc:  # not UTF-8, unreadable: said as prepare says it
        return 1, str(exc)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            return number, f"not JSON ({exc})"
        if not isinstance(row, dict):
            return number, f"not a JSON object (a {type(row).__name__})"
    return None


def read_task_yaml(path: Path) -> dict | None:
    """A task YAML as lm-eval would read it (``!function`` tags left unresolved); a file that is not UTF-8 or
    not YAML raises one ConfigError naming it (lm-eval skips such a file, so its task read as unknown)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--include-path: {path} is not UTF-8 (byte {exc.start}); save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--include-path: {path} is not valid YAML{at} ({problem})") from None


def check_task_files(include_path: str | None) -> None:
    """Read every task YAML under ``include_path`` (``read_task_yaml``): called when a task is unknown, since
    a broken file is the likely reason."""
    for path in sorted(Path(include_path).rglob("*.y*ml")) if include_path else []:
        read_task_yaml(path)


def check_servable(tasks: dict, lm, limit: int | None) -> None:
    """Refuse, before scoring, a task the model cannot serve: generation without an end-of-text token, a rolling
    log-likelihood without a BOS/EOS, a multiple-choice answer longer than the model's window (the first
    ``limit`` samples)."""
    from scaletrain.evaluation.lm_eval_model import no_end_of_text

    for name, task in tasks.items():
        kind = task.get_config("output_type")
        if kind == "generate_until" and lm.eot_token_id is None:
            raise ConfigError(f"--tasks {name}: " + no_end_of_text(lm.name))
        if kind == "loglikelihood_rolling":
            lm.prefix_token_id  # noqa: B018  (raises the one-line refusal when there is no BOS/EOS)
        if kind == "multiple_choice":
            docs = task.eval_docs
            delimiter = task.config.target_delimiter
            longest = max((len(lm.tok_encode(delimiter + choice, add_special_tokens=False))
                           for i, doc in zip(range(limit or len(docs)), docs) for choice in task.doc_to_choice(doc)),
                          default=0)
            if longest > lm.max_length:
                raise ConfigError(f"--tasks {name}: an answer of {longest} tokens is longer than the model's context "
                                  f"of {lm.max_length} (model.max_seq_len), so it cannot be scored in one window; "
                                  f"use a model with a longer context")


def check_docs(tasks: dict, request: TaskRequest) -> None:
    """Refuse, before scoring, what lm-eval would fail on mid-run with a traceback: a template that fails on a
    row, a multiple-choice label outside its choices, more few-shot examples than the task has (the first
    ``limit`` samples)."""
    import jinja2

    for name, task in tasks.items():
        docs = task.eval_docs
        multiple_choice = task.get_config("output_type") == "multiple_choice"
        for i, doc in zip(range(request.limit or len(docs)), docs):
            try:
                target = task.doc_to_target(doc)
                choices = task.doc_to_choice(doc) if multiple_choice else None
                task.doc_to_text(doc)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"--tasks {name}: sample {i} (row {i + 1} of its data): a template fails: {exc} "
                                  f"(its fields: {', '.join(doc)})") from None
            if multiple_choice and isinstance(target, int) and not 0 <= target < len(choices):
                raise ConfigError(f"--tasks {name}: sample {i} (row {i + 1} of its data): label {target} is not one "
                                  f"of its {len(choices)} choices (0 to {len(choices) - 1})")
        shots = request.num_fewshot if request.num_fewshot is not None else task.get_config("num_fewshot") or 0
        sampler = getattr(task, "sampler", None)
        if shots and sampler is not None:
            pool = sampler.fewshot_docs()
            usable = len(pool) - (1 if len(docs) and docs[0] in pool else 0)  # a sample is never its own example
            if shots > usable:
                source = "its own samples, less the one scored" if usable < len(pool) else "its few-shot split"
                raise ConfigError(f"--num-fewshot {shots}: {name} has {usable} few-shot example(s) ({source}); "
                                  f"give at most {usable}")


def task_manager(task_manager_class, paths: list[str], names: list[str]):
    """lm-eval's TaskManager for ``names``. Indexing its ~14,700 built-in task files takes 3-12 s on a 2-core CPU
    (more than scoring a small local task): when every name is a plain task of the local ``paths`` (not a group
    or tag, which may name built-in tasks), those folders alone are indexed; else everything, as lm-eval does."""
    if paths:
        local = task_manager_class(include_path=paths, include_defaults=False)
        if all(name in local.task_index and _is_plain_task(local.task_index[name]) for name in names):
            return local
    return task_manager_class(include_path=paths or None)


def _is_plain_task(entry) -> bool:
    """An index entry of a task (lm-eval 0.4.13's ``Entry.kind``; 0.4.12's dict ``type``)."""
    kind = entry.get("type") if isinstance(entry, dict) else getattr(getattr(entry, "kind", None), "name", None)
    return str(kind).lower() == "task"


class _LoadedOnce:
    """A TaskManager whose ``load`` returns what was loaded for the check (datasets read once)."""

    def __init__(self, manager, loaded: dict):
        self._manager, self._loaded = manager, loaded

    def load(self, names):
        return self._loaded

    def __getattr__(self, attr):
        return getattr(self._manager, attr)


def evaluate_tasks(request: TaskRequest, say: Callable[[str], None] = print) -> dict:
    """Score a run on lm-eval tasks (see the module docstring); prints one line a task and returns (and writes
    to ``request.json_path``) the scores with their settings."""
    request.check()
    online = hub_reachable()
    if not online:  # cached datasets still load; anything else fails at once instead of retrying for a minute
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    evaluator, TaskManager = import_lm_eval()
    import datasets

    datasets.disable_progress_bars()  # "Generating test split" bars: the task lines and lm-eval's own bars suffice
    from scaletrain.evaluation.lm_eval_model import ScaletrainLM
    from scaletrain.infer.load import load_run

    device = request.device if request.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    cfg, model, tokenizer, ckpt = load_run(request.run, device=device)
    lm = ScaletrainLM(model, tokenizer, cfg.model.max_seq_len, request.batch_size, name=str(request.run))
    if request.apply_chat_template:
        lm.chat_template(True)  # a run without a template is refused here, not after the first task
    paths = [request.include_path] if request.include_path else []
    if "gutenberg-cloze" in request.tasks:
        paths.append(str(cloze_folder(cfg, say)))
    manager = task_manager(TaskManager, paths, request.tasks)
    for name in request.tasks:
        if name not in manager.all_tasks:
            check_task_files(request.include_path)  # a YAML lm-eval skipped: named, not "unknown task"
            raise ConfigError(unknown_task(name, manager.all_tasks))
    loaded = load_tasks(manager, request.tasks, online)
    check_docs(loaded["tasks"], request)
    check_servable(loaded["tasks"], lm, request.limit)
    results = evaluator.simple_evaluate(
        model=lm, tasks=request.tasks, task_manager=_LoadedOnce(manager, loaded), num_fewshot=request.num_fewshot,
        limit=request.limit, apply_chat_template=request.apply_chat_template,
        log_samples=request.log_samples is not None, bootstrap_iters=1000, verbosity="ERROR")
    report = summarize(results, request, ckpt)
    if request.log_samples is not None:
        count = write_samples(results["samples"], request.log_samples)
        report["samples_file"] = request.log_samples
        say(f"wrote {count} samples' requests and responses to {request.log_samples}")
    if lm.skipped:  # a char tokenizer: what it could not encode was left out of the texts
        report["skipped_characters"] = sorted(lm.skipped)
        shown = ", ".join(repr(c) for c in sorted(lm.skipped)[:8]) + (", ..." if len(lm.skipped) > 8 else "")
        say(f"left out {len(lm.skipped)} distinct character(s) not in the tokenizer's vocabulary ({shown}); the "
            f"rest of each text is scored")
    for line in report_lines(report):
        say(line)
    if request.json_path:
        write_file(request.json_path, json.dumps(report, indent=2), f"the JSON {request.json_path}")
    return report


def write_samples(samples: dict[str, list[dict]], path: str) -> int:
    """lm-eval's per-sample records (what its ``--log_samples`` writes: the doc, the target, the requests'
    arguments, the responses: (log-likelihood, is greedy) per choice, a rolling log-likelihood or a generation,
    the filtered responses and the sample's metrics), one JSON line each with its ``task``; returns the count."""
    from lm_eval.utils import handle_non_serializable

    lines = [json.dumps({"task": task, **sample}, default=handle_non_serializable, ensure_ascii=False)
             for task, records in samples.items() for sample in records]
    write_file(path, "".join(line + "\n" for line in lines), f"the samples {path}")
    return len(lines)


def cloze_folder(cfg, say: Callable[[str], None]) -> Path:
    """gutenberg-cloze's task folder for the run's data (built from its validation split once)."""
    from scaletrain.data.run_data import training_data
    from scaletrain.evaluation.cloze import TASK, cloze_task_folder

    data = training_data(cfg, say=lambda _: None)
    if data.data_dir is None:
        raise ConfigError(f"--tasks {TASK}: the run trains on instruction examples ({cfg.finetune.instructions}), "
                          f"not on prepared text with a validation split to build it from")
    return cloze_task_folder(data.data_dir, data.tokenizer, say)


def summarize(results: dict, request: TaskRequest, ckpt: Path) -> dict:
    """Each task's metrics beside the settings that produced them (lm-eval's own record of them)."""
    tasks = {}
    for name, scores in results["results"].items():
        config = results["configs"].get(name, {})
        counts = results.get("n-samples", {}).get(name, {})
        metrics = {key.split(",")[0]: value for key, value in scores.items()
                   if "," in key and not key.split(",")[0].endswith("_stderr") and isinstance(value, (int, float))}
        stderr = {key.split(",")[0][:-len("_stderr")]: value for key, value in scores.items()
                  if key.split(",")[0].endswith("_stderr") and isinstance(value, (int, float))}
        tasks[name] = {"metrics": metrics, "stderr": stderr, "num_fewshot": results.get("n-shot", {}).get(name),
                       "output_type": config.get("output_type"), "limit": request.limit,
                       "samples": counts.get("effective"), "samples_in_task": counts.get("original")}
    return {"run": str(request.run), "checkpoint": str(ckpt), "tasks": tasks,
            "settings": {"limit": request.limit, "num_fewshot": request.num_fewshot,
                         "apply_chat_template": request.apply_chat_template, "batch_size": request.batch_size},
            "lm_eval_version": _lm_eval_version()}


# What each metric is, said beside its number (acc_norm: the log-likelihood divided by the choice's characters).
METRIC_NOTES = {"acc": "acc", "acc_norm": "acc_norm (per character)", "acc_bytes": "acc_bytes (per byte)",
                "exact_match": "exact_match",
                "word_perplexity": "word perplexity", "byte_perplexity": "byte perplexity",
                "bits_per_byte": "bits per byte", "perplexity": "perplexity"}


def report_lines(report: dict) -> list[str]:
    """'arc_easy: acc 0.2500 ± 0.0433, acc_norm (per character) 0.2600 ± 0.0441 (0-shot, limit 100: 100 of 2376
    samples)' for each task."""
    lines = []
    for name, task in report["tasks"].items():
        scores = ", ".join(f"{METRIC_NOTES.get(metric, metric)} {value:.4f}"
                           + (f" ± {task['stderr'][metric]:.4f}" if isinstance(task["stderr"].get(metric), float)
                              else "")
                           for metric, value in task["metrics"].items())
        shots = "?" if task["num_fewshot"] is None else task["num_fewshot"]
        limit = f"limit {task['limit']}" if task["limit"] else "no limit"
        counted = f"{task['samples']} of {task['samples_in_task']} samples" if task["samples"] is not None else ""
        lines.append(f"{name}: {scores} ({shots}-shot, {limit}" + (f": {counted}" if counted else "") + ")")
    return lines


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
