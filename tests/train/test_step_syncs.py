"""No host-device sync in the training step's hot path (train/deferred.py, issue 41): counted on a CPU.

A read back to the host is ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``, ``if t``),
``Tensor.tolist`` / ``.cpu()`` / ``.numpy()``, or an operator whose output size depends on the values (nonzero,
masked_select, unique, boolean-mask indexing); on a GPU each waits for the queue to drain. The counter sees every
one of them between the trainer's steps; the same runs' losses are bitwise those of the per-step reads."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer

# Operators whose output size depends on the values: on a GPU the host waits for them to know it.
DATA_DEPENDENT = {torch.ops.aten.nonzero, torch.ops.aten.masked_select, torch.ops.aten._unique2,
                  torch.ops.aten.unique_consecutive, torch.ops.aten.unique_dim}


class SyncCounter(TorchDispatchMode):
    """Counts reads of tensor values back to the host while active."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._patched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or func.overloadpacket in DATA_DEPENDENT or (
                func is torch.ops.aten.index.Tensor and any(t is not None and t.dtype == torch.bool for t in args[1])):
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _count_per_step(trainer: Trainer) -> tuple[list[int], list[int]]:
    """Run ``trainer.train()`` counting the syncs inside each step and inside each step's logging."""
    in_step, in_log = [], []
    counter = SyncCounter()
    timed, log_step = trainer._timed_step, trainer._log_step

    def counted_step(profiler):
        before = counter.count
        record = timed(profiler)
        in_step.append(counter.count - before)
        return record

    def counted_log(record, logger):
        before = counter.count
        log_step(record, logger)
        in_log.append(counter.count - before)

    trainer._timed_step, trainer._log_step = counted_step, counted_log
    with counter:
        trainer.train()
    return in_step, in_log


def _trainer(tmp_path, tiny, name, **extra) -> Trainer:
    over = tiny(tmp_path / name, **{"train.steps": 12, "logging.log_interval": 4, **extra})
    return Trainer(load_config(None, over), log=True)


def test_no_sync_inside_a_step_and_one_read_per_log_step(tmp_path, tiny):
    trainer = _trainer(tmp_path, tiny, "deferred")
    assert trainer._defer  # fused AdamW on the CPU, no fp16 scaler: the loop defers its reads
    in_step, in_log = _count_per_step(trainer)
    assert in_step == [0] * 12
    # logging: nothing between log steps; at steps 4, 8, 12 the pending losses and norms come back in one read
    assert [n for i, n in enumerate(in_log, 1) if i % 4] == [0] * 9
    assert all(n >= 1 for i, n in enumerate(in_log, 1) if i % 4 == 0)


def test_the_per_step_reads_it_replaces_are_counted_and_the_losses_are_bitwise_the_same(tmp_path, tiny):
    old = _trainer(tmp_path, tiny, "per-step")
    old._defer = False  # the path before issue 41 (and the one Muon, ZeRO-1, fp16 and DeepSpeed still take)
    in_step, _ = _count_per_step(old)
    assert in_step == [2] * 12  # float(grad norm), float(loss)
    new = _trainer(tmp_path, tiny, "deferred")
    _count_per_step(new)

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k in ("step", "loss", "grad_norm", "val_loss", "lr")}
                for x in lines]
    assert rows("per-step") == rows("deferred") and len(rows("deferred")) >= 4


def test_a_nonfinite_step_is_skipped_on_the_device_and_counted_at_the_next_read(tmp_path, tiny):
    trainer = _trainer(tmp_path, tiny, "nan", **{"train.rollback_after": 3, "checkpoint.interval": 0})
    assert trainer._defer
    for _ in range(2):
        trainer.step(deferred=True)
    with torch.no_grad():
        trainer.model.norm.weight[0] = math.nan  # every loss from now on is NaN
    poisoned = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    record = trainer.step(deferred=True)
    assert torch.is_tensor(record["loss"]) and trainer.guard.skipped_total == 0  # not read yet
    for k, v in trainer.model.state_dict().items():  # skipped on the device: no weight moved, no NaN spread
        assert torch.equal(v, poisoned[k]) or (torch.isnan(v).sum() == torch.isnan(poisoned[k]).sum()), k
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, trainer.optimizer.state.values()))
    events = []
    trainer._read_deferred(type("L", (), {"log": staticmethod(events.append)})(), record)
    assert trainer.guard.skipped_total == 1 and record["skipped_update"] == 1 and math.isnan(record["loss"])
    # two more bad steps, read together: the third in a row asks for a rollback, which has no checkpoint here
    trainer.step(deferred=True)
    trainer.step(deferred=True)
    from scaletrain.train.trainer import TrainingError
    with pytest.raises(TrainingError, match="no checkpoint to roll back to"):
        trainer._read_deferred(type("L", (), {"log": staticmethod(events.append)})(), {})
    assert events == [{"step": 4, "skipped_update": 1}]  # the step read before the current one: its own event


def test_the_cuda_step_clock_waits_once_per_read_not_per_step(monkeypatch):
    """On CUDA the step times come from timing events: recording them never waits; reading them waits for the
    last event only (fake events stand in for torch.cuda.Event on this CPU machine)."""
    from scaletrain.train.metrics import StepClock

    waits, clock_ms = [], iter(range(0, 1000, 10))

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.ms = next(clock_ms)

        def synchronize(self):
            waits.append(self)

        def elapsed_time(self, end):
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = StepClock(torch.device("cuda"))
    for _ in range(5):
        clock.start()
        clock.stop()
    assert waits == []
    assert clock.times() == [0.01] * 5 and len(waits) == 1
    assert clock.times() == [0.01] * 5 and len(waits) == 1  # nothing pending: no second wait


@pytest.mark.parametrize("defer, reads", [(True, 0.0), (False, 2.0)])
def test_the_profile_breakdown_counts_the_step_syncs_and_names_the_attention_op(tmp_path, tiny, defer, reads):
    """profile.enabled writes breakdown_rank0.json (train/profile.py): on a CPU no kernels, but the attention
    backend the step called and the program's value reads per profiled step (none between log steps now)."""
    over = tiny(tmp_path / "run", **{"train.steps": 8, "profile.enabled": "true", "profile.wait": 2,
                                     "profile.warmup": 1, "profile.active": 3, "logging.log_interval": 10})
    trainer = Trainer(load_config(None, over), log=False)
    trainer._defer = defer
    trainer.train()
    parts = json.loads((tmp_path / "run" / "profile" / "breakdown_rank0.json").read_text())
    assert parts["profiled_steps"] == 3 and parts["kernel_ms"] == 0 and parts["step_ms"] > 0
    assert any("scaled_dot_product" in name for name in parts["attention_ops"])
    assert parts["syncs_per_step"] == {"value_reads": reads, "cuda_synchronize_calls": 0.0}


def test_the_breakdown_of_a_gpu_trace_splits_kernels_from_gaps_and_by_kind():
    from scaletrain.train.profile import breakdown

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    trace = {"traceEvents": [
        x("user_annotation", "ProfilerStep#5", 0, 100), x("user_annotation", "ProfilerStep#6", 100, 100),
        x("kernel", "sm90_xmma_gemm_bf16", 10, 30), x("kernel", "flash_fwd_kernel", 35, 10),  # overlaps the gemm
        x("kernel", "triton_red_fused__log_softmax_0", 60, 10), x("kernel", "multi_tensor_apply_kernel<adam>",
                                                                  150, 20),
        x("gpu_memcpy", "Memcpy HtoD", 190, 10), x("cpu_op", "aten::_scaled_dot_product_flash_attention", 5, 3),
        x("cuda_runtime", "cudaStreamSynchronize", 180, 5), x("cpu_op", "Optimizer.step#AdamW.step", 120, 8)]}
    parts = breakdown(trace)
    assert parts["profiled_steps"] == 2 and parts["kernels_per_step"] == 2.0
    assert parts["kernel_ms"] == 0.04 and parts["gpu_busy_ms"] == pytest.approx(0.0375, abs=1e-3)
    assert parts["gpu_span_ms"] == 0.095  # 10 .. 200 us over two steps
    assert parts["launch_gap_share"] == round(1 - 75 / 190, 4)
    assert parts["kernel_ms_by_kind"] == {"attention": 0.005, "loss_head": 0.005, "matmul": 0.015,
                                          "memcpy_memset": 0.005, "optimizer": 0.01}
    assert parts["top_attention_kernels"] == ["flash_fwd_kernel"]
    assert parts["attention_ops"] == {"aten::_scaled_dot_product_flash_attention": 0.5}
    assert parts["syncs_per_step"]["cuda_synchronize_calls"] == 0.5 and parts["optimizer_step_host_ms"] == 0.004


def test_the_counter_sees_every_kind_of_read():
    t = torch.arange(6.0)
    with SyncCounter() as counter:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t[t > 2]  # a boolean mask: its size depends on the values
        torch.nonzero(t)
        t.tolist()
        t.clone().add_(1)  # stays on the device: not a read
    assert counter.count == 6
