"""Resilience on one process: kill -9 and SIGTERM at random steps, a SIGTERM or kill during an
asynchronous save, damaged checkpoints, retention, and the NaN/Inf guard. Every resumed run must end
bitwise identical to an uninterrupted one."""

from __future__ import annotations

import json
import math
import random
import signal

import pytest
import torch

from helpers.faults import (
    assert_same_run,
    finish,
    last_step,
    launch,
    output,
    reference_run,
    run_ok,
    train_args,
    wait_for,
)
from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import load_config
from scaletrain.train.preemption import PREEMPTED_EXIT_CODE
from scaletrain.train.trainer import Trainer

STEPS, INTERVAL = 60, 5


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run (synchronous checkpoints every 5 steps)."""
    return reference_run(tmp_path_factory.mktemp("straight"), STEPS, INTERVAL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill9_at_a_random_step_then_resume_is_bitwise_exact(straight, tmp_path, seed):
    config, reference = straight
    run = tmp_path / "run"
    kill_at = random.Random(seed).randint(3, STEPS - 8)
    proc = launch(train_args(config, run))
    wait_for(lambda: last_step(run) >= kill_at, proc, what=f"step {kill_at}")
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    stopped = last_step(run)
    assert stopped < STEPS, "the run finished before the kill landed"
    out = run_ok(train_args(config, run, "--resume"))
    assert "resumed from" in out
    assert_same_run(reference, run)


def test_sigterm_finishes_the_step_checkpoints_and_exits_75(straight, tmp_path):
    config, reference = straight
    run = tmp_path / "run"
    proc = launch(train_args(config, run))
    wait_for(lambda: last_step(run) >= 13, proc, what="step 13")
    proc.send_signal(signal.SIGTERM)
    code = finish(proc)
    text = output(proc)
    assert code == PREEMPTED_EXIT_CODE, text[-3000:]
    assert "stopped at step" in text and "(SIGTERM)" in text
    stopped = last_step(run)
    newest = CheckpointManager(run / "checkpoints").latest()
    assert newest is not None and CheckpointManager.read_meta(newest)["step"] == stopped  # nothing lost
    run_ok(train_args(config, run, "--resume"))
    assert_same_run(reference, run)


def test_trigger_file_preempts(straight, tmp_path):
    config, _ = straight
    run, trigger = tmp_path / "run", tmp_path / "spot-notice"
    proc = launch(train_args(config, run, f"--checkpoint.trigger_file={trigger}"))
    wait_for(lambda: last_step(run) >= 4, proc, what="step 4")
    trigger.write_text("reclaimed in 120 s")
    assert finish(proc) == PREEMPTED_EXIT_CODE
    assert f"(trigger file {trigger})" in output(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_during_an_async_save(straight, tmp_path, sig):
    """The save of step 5 is in flight (slow disk: 1.5 s) while training goes on. SIGTERM: the loop
    finishes its step, completes the pending save, writes its own and exits 75. SIGKILL: the partial
    folder is ignored and the previous checkpoint used. Either way the resumed run is exact."""
    config, reference = straight
    run = tmp_path / "run"
    proc = launch(train_args(config, run, "--checkpoint.async_save=true"), SLOW_FINALIZE="1.5")
    partial = run / "checkpoints" / ".step-00000005.tmp"
    wait_for(lambda: partial.is_dir() and last_step(run) >= 7, proc, what="training during the async save")
    proc.send_signal(sig)
    code = finish(proc)
    if sig == signal.SIGTERM:
        assert code == PREEMPTED_EXIT_CODE, output(proc)[-3000:]
        steps = [int(p.name[5:]) for p in CheckpointManager(run / "checkpoints").list_complete()]
        assert 5 in steps and steps[-1] == last_step(run)  # the in-flight save completed, then the final one
    else:
        assert code == -signal.SIGKILL
        assert partial.is_dir() and not (run / "checkpoints" / "step-00000005").exists()
    for path in CheckpointManager(run / "checkpoints").list_complete():
        CheckpointManager.verify(path)
    out = run_ok(train_args(config, run, "--resume", "--checkpoint.async_save=true"))
    assert "resumed from" in out or sig == signal.SIGKILL  # after an early kill there may be no checkpoint
    assert not partial.exists()
    assert_same_run(reference, run)


def _tiny_trainer(tmp_path, tiny, **extra):
    return Trainer(load_config(None, tiny(tmp_path / "run", **extra)), log=False)


def _damage(path, how: str) -> None:
    if how == "truncated shard":
        f = path / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "deleted marker":
        (path / "meta.json").unlink()
    elif how == "damaged marker":  # before: a JSONDecodeError traceback from the run folder's claim
        (path / "meta.json").write_text("{bad")
    elif how == "deleted rank file":
        (path / "rank-00000.pt").unlink()
    elif how == "flipped byte":
        f = path / "rank-00000.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("how,message", [("truncated shard", "checksum mismatch"),
                                         ("deleted marker", "incomplete (no meta.json)"),
                                         ("damaged marker", "meta.json: unreadable marker"),
                                         ("deleted rank file", "rank-00000.pt: missing"),
                                         ("flipped byte", "checksum mismatch")])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, tiny, capsys, how, message):
    from scaletrain.cli import main

    over = tiny(tmp_path / "run", **{"checkpoint.interval": 5, "checkpoint.keep_last": 3, "train.steps": 15})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    newest = tmp_path / "run" / "checkpoints" / "step-00000015"
    _damage(newest, how)
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={tmp_path / 'run'}", "--train.stop_at_step=12"]) == 0
    out = capsys.readouterr().out
    assert message in out and f"{newest.name}" in out, out
    assert "resumed from" in out and "(step 10), the newest valid checkpoint (step-00000015 is damaged" in out


@pytest.mark.parametrize("how,message", [("truncated shard", "__0_0.distcp: checksum mismatch"),
                                         ("deleted marker", "step-00000005: incomplete (no meta.json)"),
                                         ("damaged marker", "step-00000005/meta.json: unreadable marker"),
                                         ("deleted rank file", "rank-00000.pt: missing")])
def test_resume_with_only_a_damaged_checkpoint_is_refused(tmp_path, tiny, capsys, how, message):
    """Not "no checkpoint, starting from scratch" (a run silently thrown away): exit 2 naming the damage and
    --overwrite; nothing was trained and the damaged checkpoint is still there."""
    from scaletrain.cli import main

    over = tiny(tmp_path / "run", **{"checkpoint.interval": 5, "train.steps": 5})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    only = tmp_path / "run" / "checkpoints" / "step-00000005"
    _damage(only, how)
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={tmp_path / 'run'}", "--train.steps=8"]) == 2
    out, err = capsys.readouterr()
    assert "starting from scratch" not in out + err and "done:" not in out
    assert err.startswith("CheckpointError: no valid checkpoint to resume from") and message in err, err
    assert "--overwrite" in err and len(err.strip().splitlines()) == 1
    run = tmp_path / "run"
    assert only.is_dir() and not (run / "checkpoints" / "step-00000008").exists()
    assert (run / "config.toml").is_file() and not list(run.glob("replaced-*"))  # nothing moved aside either
    # --overwrite starts over as the line says: the damaged checkpoint goes
    fresh = tiny(run, **{"checkpoint.interval": 3, "train.steps": 3})
    assert main(["train", "--overwrite"] + [f"--{k}={v}" for k, v in fresh.items()]) == 0
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000003"]


def test_a_checkpoint_copied_from_another_run_is_skipped_or_refused(tmp_path, tiny, capsys):
    """Before: loaded, then "cannot resume the data stream: seed was 7, now 1337". Now the run id (run.json, in
    each checkpoint's meta.json) tells the copy apart: the run goes on from its own older checkpoint, and a run
    with none of its own is refused in one line naming the copy."""
    import shutil

    from scaletrain.cli import main

    other, mine, empty = tmp_path / "other", tmp_path / "mine", tmp_path / "empty"
    for run, extra in ((other, {"train.seed": 7, "train.steps": 10}), (mine, {"train.steps": 5}),
                       (empty, {"train.steps": 2, "checkpoint.enabled": "false"})):
        over = tiny(run, **{"checkpoint.interval": 5, **extra})
        assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    for run in (mine, empty):
        (run / "checkpoints").mkdir(exist_ok=True)
        shutil.copytree(other / "checkpoints" / "step-00000010", run / "checkpoints" / "step-00000010")
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={mine}", "--train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "step-00000010: belongs to another run" in out and "seed" not in out, out
    assert f"resumed from {mine / 'checkpoints' / 'step-00000005'} (step 5), the newest valid checkpoint " \
           f"(step-00000010 is another run's" in out, out
    assert main(["train", "--resume", f"--train.run_dir={empty}", "--train.steps=7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("CheckpointError: no valid checkpoint to resume from") and len(err.strip().splitlines()) == 1
    assert "step-00000010: belongs to another run" in err and "seed" not in err, err


def test_a_resume_without_config_toml_goes_on_with_the_checkpoints_config(tmp_path, tiny, capsys):
    """Before: the run folder's config.toml deleted, --resume went on under the default config (1,500 steps, another
    model) without a word. Now the config saved with the checkpoint is restored (said in one line); a checkpoint
    that holds none, with no --config to say what the run was, is refused in one line."""
    from scaletrain.cli import main

    run = tmp_path / "run"
    over = tiny(run, **{"checkpoint.interval": 5, "train.steps": 8, "train.stop_at_step": 5})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    (run / "config.toml").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "config.toml was missing; restored it from the config saved with checkpoint step-00000005" in out, out
    assert "done: 8 steps" in out and load_config(run / "config.toml").model.dim == 32, out
    (run / "config.toml").unlink()
    for path in (run / "checkpoints").glob("step-*"):  # as a checkpoint written before configs were kept
        meta = json.loads((path / "meta.json").read_text())
        del meta["config"]
        (path / "meta.json").write_text(json.dumps(meta))
    assert main(["train", "--resume", f"--train.run_dir={run}", "--train.steps=10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ConfigError: --resume:") and "config.toml is missing" in err and "--config" in err
    assert len(err.strip().splitlines()) == 1 and not (run / "config.toml").exists()


def test_retention_keeps_last_and_every(tmp_path, tiny):
    trainer = _tiny_trainer(tmp_path, tiny, **{"train.steps": 12, "checkpoint.interval": 2, "checkpoint.keep_last": 2,
                                                "checkpoint.keep_every": 4})
    trainer.train()
    kept = [p.name for p in CheckpointManager(tmp_path / "run" / "checkpoints").list_complete()]
    assert kept == ["step-00000004", "step-00000008", "step-00000010", "step-00000012"]


def test_async_save_resume_is_bitwise_exact(tmp_path, tiny):
    from scaletrain.cli import main

    common = {"checkpoint.interval": 5, "checkpoint.async_save": "true", "logging.log_interval": 1}
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny(straight, **common).items()]) == 0
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny(split, **common, **{"train.stop_at_step": 17}).items()]) == 0
    assert main(["train", "--resume", f"--train.run_dir={split}"]) == 0
    assert_same_run(straight, split)


def test_nan_guard_skips_then_rolls_back_and_skips_the_data(tmp_path, tiny):
    trainer = _tiny_trainer(tmp_path, tiny, **{"train.rollback_after": 3})
    for _ in range(5):
        trainer.step()
    trainer.save()
    good = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    cursor_at_save = trainer.train_loader.state_dict()["cursor"]
    for _ in range(2):
        trainer.step()
    with torch.no_grad():  # a corrupted weight: every loss from now on is NaN
        trainer.model.norm.weight[0] = math.nan
    poisoned = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    first = trainer.step()
    assert first.get("skipped_update") == 1 and math.isnan(first["loss"])
    for k, v in trainer.model.state_dict().items():  # a skipped step changes no weight
        assert torch.equal(v, poisoned[k]) or torch.isnan(v).any(), k
    trainer.step()
    trainer.step()  # the third bad step in a row: roll back to step 5
    assert trainer.guard.rollbacks == 1 and trainer.guard.skipped_total == 3
    assert trainer.state.step == 5
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, good[k]), k
    # the data position was kept: the 5 batches consumed since the checkpoint are not replayed
    assert trainer.train_loader.state_dict()["cursor"] == cursor_at_save + 5 * 4
    after = trainer.step()
    assert math.isfinite(after["loss"]) and "skipped_update" not in after and trainer.state.step == 6


def test_nan_guard_without_checkpoint_stops_with_a_clear_error(tmp_path, tiny):
    from scaletrain.train.trainer import TrainingError

    trainer = _tiny_trainer(tmp_path, tiny, **{"train.rollback_after": 2})
    with torch.no_grad():
        trainer.model.norm.weight[0] = math.inf
    trainer.step()
    with pytest.raises(TrainingError, match="no checkpoint to roll back to"):
        trainer.step()
