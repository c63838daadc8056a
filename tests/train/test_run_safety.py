"""Never lose a run (issue: one writer per run folder, full disks, Ctrl-C, untrusted inputs).

Each everyday accident is replayed as a real process: a second run started into a folder that holds a
run, two processes on one folder, a disk that refuses a checkpoint's bytes (a real kernel error: the
process's file size limit, RLIMIT_FSIZE), Ctrl-C once and twice, and files from someone else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers.faults import (
    HELPERS,
    assert_same_run,
    env,
    finish,
    last_step,
    launch,
    output,
    reference_run,
    run_ok,
    train_args,
    wait_for,
)
from helpers.waits import CEILING_S
from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.run_folder import checkpoint_disk_check, claim_run_folder
from scaletrain.core.files import StorageError, guarded_write, is_storage_error
from scaletrain.core.options import ConfigError
from scaletrain.core.writer_lock import LOCK_FILE, RunLock
from scaletrain.train.preemption import INTERRUPTED_EXIT_CODE, SAME_CTRL_C

STEPS, INTERVAL = 30, 5


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run."""
    return reference_run(tmp_path_factory.mktemp("straight"), STEPS, INTERVAL)


def steps_in(run) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Error:" in line]


# -- accident 1: a second run into a folder that holds one -----------------------------------------------------
def test_a_fresh_start_over_an_earlier_run_is_refused_and_loses_nothing(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.steps=10"))
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    metrics = (run / "metrics.jsonl").read_text()

    text = run_ok(train_args(config, run, "--train.steps=20", "--optim.lr=0.01"), expect=2)
    (line,) = error_lines(text)
    assert "holds checkpoints of an earlier run (step 10" in line
    assert "--resume" in line and "--overwrite" in line and "train.run_dir" in line
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == before
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing appended


def test_overwrite_replaces_the_earlier_run_and_keeps_its_logs(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.steps=10"))
    old_metrics = (run / "metrics.jsonl").read_text()
    text = run_ok(train_args(config, run, "--train.steps=5", "--overwrite"))
    assert "--overwrite: deleted the earlier run's" in text
    assert steps_in(run) == [5]  # only the new run's checkpoints
    (replaced,) = run.glob("replaced-*")
    assert (replaced / "metrics.jsonl").read_text() == old_metrics
    new = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in new) == 5  # the new metrics hold only the new run
    meta = CheckpointManager.read_meta(run / "checkpoints" / "step-00000005")
    assert meta["run_id"] == json.loads((run / "run.json").read_text())["run_id"]


def test_resume_and_overwrite_together_are_refused(straight, tmp_path):
    config, _ = straight
    text = run_ok(train_args(config, tmp_path / "run", "--resume", "--overwrite"), expect=2)
    assert "contradict" in error_lines(text)[0]


def test_retention_only_deletes_the_current_runs_checkpoints(tmp_path):
    """keep_last counts this run's checkpoints only: an earlier run's higher steps neither count towards it
    nor make the new run's checkpoints look old."""
    folder = tmp_path / "checkpoints"
    old = CheckpointManager(folder, keep_last=1, run_id="old")
    for step in (100, 200):
        old.save(step, {"model": {"w": torch.ones(2)}}, {}, {})
    new = CheckpointManager(folder, keep_last=2, run_id="new")
    for step in (1, 2, 3):
        new.save(step, {"model": {"w": torch.zeros(2)}}, {}, {})
    assert [p.name for p in new.list_complete()] == ["step-00000002", "step-00000003", "step-00000200"]
    assert CheckpointManager.read_meta(folder / "step-00000003")["run_id"] == "new"


# -- two processes on one folder ------------------------------------------------------------------------------
@pytest.mark.slow  # the quick pass's slowest on a shared 2-core AVX2 EPYC (882 s serially under a load of ~15,
# 4x the next; 123 s under ~6): the refused process starts beside a run that keeps training
def test_a_second_process_on_a_folder_in_use_stops_naming_the_holder(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    long = ("--train.steps=100000", "--checkpoint.interval=0")
    first = launch(train_args(config, run, *long))
    try:
        wait_for(lambda: last_step(run) >= 2, first, what="step 2")
        text = run_ok(train_args(config, run, *long, "--resume"), expect=2)
        (line,) = error_lines(text)
        assert f"is in use by process {first.pid}" in line
    finally:
        first.kill()  # kill -9: no chance to release anything
        first.wait()
    # The kernel dropped the dead process's lock: the folder is free again at once.
    out = run_ok(train_args(config, run, "--resume", "--train.steps=3", "--checkpoint.interval=0"))
    assert "in use" not in out


def test_a_stale_lock_record_without_flock_is_taken_over(tmp_path, monkeypatch):
    """On a file system without flock the record is the lock: a dead holder's record is taken over, a live
    one's refused."""
    import fcntl

    def no_flock(*args):
        raise OSError(38, "Function not implemented")  # ENOSYS

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout)}))
    lock = RunLock(run)
    lock.acquire()  # the holder is gone
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (run / LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": os.getppid()}))
    with pytest.raises(ConfigError, match=f"in use by process {os.getppid()}"):
        RunLock(run).acquire()


def test_claim_is_unit_testable_without_a_trainer(tmp_path):
    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints", run_id="a")
    (tmp_path / "run").mkdir()
    first = claim_run_folder(tmp_path / "run", ckpt, resume=False, overwrite=False)
    ckpt.run_id = first
    ckpt.save(1, {"model": {"w": torch.ones(1)}}, {}, {})
    assert claim_run_folder(tmp_path / "run", ckpt, resume=True, overwrite=False) == first
    with pytest.raises(ConfigError, match="holds checkpoints"):
        claim_run_folder(tmp_path / "run", ckpt, resume=False, overwrite=False)


# -- accident 2: a full disk ----------------------------------------------------------------------------------
LIMITED = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a kill
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from scaletrain.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def run_with_file_limit(limit: int, args: list[str]) -> tuple[int, str]:
    """``scaletrain`` in a process that may write no file larger than ``limit`` bytes (a real EFBIG from the
    kernel, as a full disk gives ENOSPC, through the same write paths)."""
    script = LIMITED.format(tests=str(HELPERS))
    proc = subprocess.run([sys.executable, "-c", script, str(limit), *args], capture_output=True, text=True,
                          env=env(), timeout=CEILING_S)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_the_previous_one_valid(straight, tmp_path,
                                                                                      async_save):
    config, reference = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.stop_at_step=10"))  # checkpoints 5 and 10, the data prepared
    shard = max((p.stat().st_size for p in (run / "checkpoints" / "step-00000010").iterdir()), default=0)
    code, text = run_with_file_limit(shard // 2, train_args(config, run, "--resume", "--train.stop_at_step=20",
                                                            f"--checkpoint.async_save={str(async_save).lower()}"))
    assert code == 2, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("StorageError:")]
    assert "writing checkpoint" in line and "free on the disk" in line
    assert "File too large" in line or "the disk refused the write" in line
    assert "the previous checkpoint step-00000010 is intact" in line
    assert not list((run / "checkpoints").glob(".step-*"))  # the half-written folder is gone
    assert steps_in(run) == [5, 10]
    CheckpointManager.verify(run / "checkpoints" / "step-00000010")
    # With room again, the run resumes from step 10 and ends exactly as if nothing had happened.
    run_ok(train_args(config, run, "--resume", f"--checkpoint.async_save={str(async_save).lower()}"))
    assert_same_run(reference, run)


def test_no_room_for_one_checkpoint_is_refused_before_training(tmp_path, tiny, monkeypatch, capsys):
    import scaletrain.checkpoint.run_folder as run_folder_module
    from scaletrain.cli import main

    monkeypatch.setattr(run_folder_module, "free_bytes", lambda path: 1000)
    overrides = tiny(tmp_path / "run", **{"train.steps": 2})
    argv = ["train", *[f"--{k}={v}" for k, v in overrides.items()]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "one checkpoint takes about" in err and "only 1.0 KB are free" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_disk_check_refuses_warns_or_passes():
    with pytest.raises(ConfigError, match="one checkpoint takes about 2.0 MB"):
        checkpoint_disk_check("run", 2_000_000, 3, free=1_000_000)
    assert "need 6.0 MB" in checkpoint_disk_check("run", 2_000_000, 3, free=5_000_000)
    assert checkpoint_disk_check("run", 2_000_000, 3, free=7_000_000) is None


def test_guarded_write_removes_the_temporary_and_passes_bugs_through(tmp_path):
    tmp = tmp_path / "partial.tmp"
    with pytest.raises(StorageError, match="writing the thing failed: No space left on device"):
        with guarded_write("the thing", tmp_path, cleanup=(tmp,), needed=10**6, intact="the old one is fine"):
            tmp.write_text("half")
            raise OSError(28, "No space left on device")
    assert not tmp.exists()
    with pytest.raises(ZeroDivisionError):  # a bug is not a storage error: its traceback stays
        with guarded_write("the thing", tmp_path):
            1 / 0
    assert is_storage_error(RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64"))


SEVERAL_LIMITED = textwrap.dedent("""
    import contextlib, io, json, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from scaletrain.cli import main
    for limit, argv in json.loads(sys.argv[1]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        print(json.dumps([code, err.getvalue()]))
""")


@pytest.mark.slow  # one process scoring, drawing and planning: ~60 s on 2 loaded cores
def test_an_output_that_does_not_fit_leaves_the_previous_file_and_no_partial_one(straight, tmp_path):
    """report --out, plan --json and eval --json on a disk that refuses the bytes (a real EFBIG from the kernel, in
    one process): one line naming the path, the earlier file there unchanged (before: truncated to the limit's
    4,096 bytes), and a new path left absent (before: a 0-byte or truncated file)."""
    _, run = straight
    folder = tmp_path / "out"
    folder.mkdir()
    earlier = folder / "earlier.out"
    earlier.write_text("the user's earlier result\n")
    commands = [(4096, ["report", str(run), "--out"]), (4096, ["plan", "--model.preset=gpt2-124m", "--hardware",
                                                               "h100-sxm:8", "--json"]),
                (256, ["eval", "--run", str(run), "--json"])]  # each limit below what it writes (eval: ~1 KB)
    calls = [(limit, [*argv, str(target)]) for limit, argv in commands for target in (earlier, folder / "new.out")]
    proc = subprocess.run([sys.executable, "-c", SEVERAL_LIMITED, json.dumps(calls)], capture_output=True,
                          text=True, env=env(), timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(calls), proc.stdout[-3000:]
    for (_, argv), (code, err) in zip(calls, results):
        assert code == 2, (argv, err)
        (line,) = [line for line in err.splitlines() if line.startswith("StorageError:")]
        assert argv[-1] in line and "File too large" in line and "Traceback" not in err, (argv, err)
        assert ("the previous" in line) == (argv[-1] == str(earlier)), line
    assert sorted(p.name for p in folder.iterdir()) == ["earlier.out"]  # no new file, no temporary
    assert earlier.read_text() == "the user's earlier result\n"


def test_write_file_replaces_whole_and_keeps_the_mode(tmp_path):
    from scaletrain.core.files import write_file

    target = tmp_path / "x.json"
    target.write_text("old")
    target.chmod(0o600)
    write_file(target, "new")
    assert target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    with pytest.raises(StorageError, match="is a folder where a file was to be written"):
        write_file(tmp_path, "x")
    with pytest.raises(StorageError, match=f"{target} is a file, not a folder"):
        write_file(target / "a" / "y.json", "x")
    write_file(tmp_path / "new" / "y.json", "one level is made")
    assert (tmp_path / "new" / "y.json").read_text() == "one level is made"


def test_eval_json_into_a_missing_folder_is_refused_before_scoring(straight, tmp_path, capsys, monkeypatch):
    """Before: scored first (minutes on a real run), then "0 B free on the disk of ..."; now refused at once with
    the reason (the folder does not exist), the run never loaded."""
    import scaletrain.infer.load as run_module
    from scaletrain.cli import main

    _, run = straight
    monkeypatch.setattr(run_module, "load_run", lambda *a, **k: pytest.fail("the run was loaded and scored"))
    target = tmp_path / "missing" / "dir" / "x.json"
    assert main(["eval", "--run", str(run), "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"the folder {target.parent} does not exist" in err and "free on the disk" not in err, err
    assert not (tmp_path / "missing").exists()
    assert main(["eval", "--run", str(run), "--tasks", "gutenberg-cloze", "--json", str(target)]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- accident 3: Ctrl-C ---------------------------------------------------------------------------------------
def test_ctrl_c_finishes_the_step_saves_and_exits_130(straight, tmp_path):
    config, reference = straight
    run = tmp_path / "run"
    proc = launch(train_args(config, run))
    wait_for(lambda: last_step(run) >= 12, proc, what="step 12")
    proc.send_signal(signal.SIGINT)
    code = finish(proc)
    text = output(proc)
    assert code == INTERRUPTED_EXIT_CODE, text[-3000:]
    stopped = last_step(run)
    assert f"interrupted (Ctrl-C) at step {stopped}: checkpoint written to" in text and "--resume" in text
    assert steps_in(run)[-1] == stopped  # the work since the last periodic checkpoint is kept
    run_ok(train_args(config, run, "--resume"))
    assert_same_run(reference, run)


def test_a_second_ctrl_c_stops_at_once(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    # The save on Ctrl-C outlasts any wait (helpers/waits.py): the process can end only by the second Ctrl-C,
    # however slow the machine (before: a 30 s save and a 20 s wait, which a machine 1.5x slower could fail).
    proc = launch(train_args(config, run), SLOW_FINALIZE=str(10 * CEILING_S))
    wait_for(lambda: last_step(run) >= 3, proc, what="step 3")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: list((run / "checkpoints").glob(".step-*")), proc, what="the save on Ctrl-C")
    time.sleep(SAME_CTRL_C + 0.5)  # closer together, two SIGINTs are one Ctrl-C (torchrun forwards it)
    proc.send_signal(signal.SIGINT)
    code = finish(proc)  # it ends only if the second Ctrl-C stopped it: the save would take ten ceilings
    assert code == INTERRUPTED_EXIT_CODE
    assert "a second Ctrl-C" in output(proc)
    # The interrupted save never completed; the next run cleans it up and resumes from what is complete.
    assert all(CheckpointManager.verify(p) for p in (run / "checkpoints").glob("step-*"))


@pytest.mark.distributed
def test_ctrl_c_under_torchrun_saves_on_every_rank(straight, tmp_path):
    """A terminal's Ctrl-C reaches torchrun and its workers (one process group): the ranks agree on the
    step, write one checkpoint of it together, and the run resumes from there."""
    config, _ = straight
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HELPERS / "fault_train.py"), *train_args(config, run, "--parallel.dp_shard=2")]
    log = (tmp_path / "log.txt").open("w+")
    proc = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log  # what wait_for shows if the run ends first
    try:
        wait_for(lambda: last_step(run) >= 6, proc, what="step 6")
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        proc.wait(timeout=CEILING_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(tmp_path / "log.txt").read()
    assert "interrupted (Ctrl-C) at step" in text, text[-3000:]
    stopped = int(text.split("interrupted (Ctrl-C) at step ")[1].split(":")[0])
    assert steps_in(run)[-1] == stopped
    CheckpointManager.verify(run / "checkpoints" / f"step-{stopped:08d}")
    out = run_ok(train_args(config, run, "--parallel.dp_shard=2", "--resume", f"--train.steps={stopped + 2}"),
                 nproc=2)
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped:08d}'}" in out


# -- untrusted inputs -----------------------------------------------------------------------------------------
class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_checkpoint_with_code_in_its_pickle_is_refused_without_running_it(straight, tmp_path, monkeypatch):
    """A rank file carrying a pickled call (checksum re-recorded, as an attacker would) is refused by
    weights_only=True in one line; the call never runs."""
    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.stop_at_step=5"))
    step = run / "checkpoints" / "step-00000005"
    torch.save({"train_state": _Boom()}, step / "rank-00000.pt")
    meta = json.loads((step / "meta.json").read_text())
    from scaletrain.core.files import file_sha256

    meta["files"]["rank-00000.pt"] = file_sha256(step / "rank-00000.pt")
    (step / "meta.json").write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    text = run_ok(train_args(config, run, "--resume"), expect=2)
    assert not (tmp_path / "PWNED").exists()
    (line,) = error_lines(text)
    assert "rank-00000.pt" in line and "weights_only" in line


def test_a_malformed_tokenizer_is_one_line(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.stop_at_step=5"))
    (run / "tokenizer.json").write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "generate", "--run", str(run)], capture_output=True,
                          text=True, env=env(), timeout=CEILING_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert "tokenizer.json" in line


def test_an_export_that_does_not_fit_is_one_line_and_keeps_the_previous_export(straight, tmp_path):
    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.stop_at_step=5"))
    run_ok(["export", "--run", str(run)])
    before = (run / "export-hf" / "model.safetensors").read_bytes()
    code, text = run_with_file_limit(len(before) // 2, ["export", "--run", str(run), "--overwrite"])
    assert code == 2, text[-2000:]
    (line,) = [line for line in text.splitlines() if line.startswith("StorageError:")]
    assert "writing the export" in line and "needs about" in line
    assert not list(run.glob(".export-hf.tmp*"))  # the partial export is gone (.export-hf.lock: its one-writer lock)
    assert (run / "export-hf" / "model.safetensors").read_bytes() == before  # the previous one untouched


def test_prepare_that_does_not_fit_is_one_line_without_leftovers(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    import random

    rng = random.Random(0)
    words = "the a bright cold day April clocks were striking thirteen Winston Smith chin nuzzled breast".split()
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(60)) + "." for _ in range(500))
    (books / "a.txt").write_text(text)
    out = tmp_path / "prepared"
    code, text = run_with_file_limit(20_000, ["prepare", str(books), "--out", str(out)])
    assert code == 2, text[-2000:]
    (line,) = [line for line in text.splitlines() if line.startswith("StorageError:")]
    assert f"writing prepared data in {out} failed" in line and "run again" in line
    assert not list(out.rglob("*.tmp")) and not (out / "manifest.json").exists()


def test_a_checkpoint_index_with_code_in_it_is_refused_without_running_it(straight, tmp_path, monkeypatch):
    """DCP reads its .metadata index with plain pickle: a tampered index (checksum re-recorded) is refused
    before DCP sees it, and the resume falls back to the previous checkpoint."""
    import pickle

    from scaletrain.core.files import file_sha256

    config, _ = straight
    run = tmp_path / "run"
    run_ok(train_args(config, run, "--train.stop_at_step=10"))
    step = run / "checkpoints" / "step-00000010"
    (step / ".metadata").write_bytes(pickle.dumps(_Boom()))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"][".metadata"] = file_sha256(step / ".metadata")
    (step / "meta.json").write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    text = run_ok(train_args(config, run, "--resume", "--train.stop_at_step=12"))
    assert not (tmp_path / "PWNED").exists()
    assert "not a plain DCP index (refers to posix.system)" in text
    assert f"resumed from {run / 'checkpoints' / 'step-00000005'}" in text


def test_the_index_check_takes_enum_members_by_getattr_and_nothing_else(tmp_path):
    """Python 3.11.2 and 3.12+ pickle DCP's memory-format enum member as getattr(Enum, NAME): accepted; getattr
    on anything else (a method of an allowed type, the way to a file write) is refused."""
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from scaletrain.checkpoint.manager import CheckpointError, check_dcp_index

    class Member:
        def __reduce__(self):
            return (getattr, (_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"))

    class Method:
        def __reduce__(self):
            return (getattr, (pathlib.PosixPath, "write_text"))

    (tmp_path / ".metadata").write_bytes(pickle.dumps([Member()]))
    check_dcp_index(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps([Method()]))
    with pytest.raises(CheckpointError, match=r"getattr\(PosixPath, 'write_text'\)"):
        check_dcp_index(tmp_path)
