"""Low-communication data parallelism for slow interconnects: local SGD and DiLoCo.

Each replica trains on its own data with its own AdamW ("inner" steps) and *no* gradient all-reduce.
Every ``sync_every`` (H) steps the replicas are brought back together with a single all-reduce of the
flattened weights:

- local SGD: the weights are averaged.
- DiLoCo (Douillard et al., 2023): the *pseudo-gradient* (global weights - local weights) is averaged and
  applied to the global weights by an outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9 in the
  paper); every replica then restarts from the new global weights.

Communication is one all-reduce of the model's size every H steps instead of one every step (DDP).
Inner optimizer states stay local and are not averaged.

``ReplicaSync`` is the one interface the trainer talks to about how replicas stay together; the default
(every step, through DDP/FSDP's gradient averaging) and ``LowCommSync`` differ only behind it: which loss
a step reports, whether a run may roll back, how replicas are named in a checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.parallel.ddp import CommCounter
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.reduce import global_mean


class ReplicaSync:
    """Replicas kept identical every step (DDP/FSDP average the gradients): nothing to do between steps.

    Subclasses whose replicas drift apart between synchronisations set ``independent``."""

    independent = False  # True: replicas hold different weights between synchronisations

    def step_loss(self, loss: torch.Tensor | None, dims: ParallelDims, device: torch.device) -> torch.Tensor:
        """The loss a step or an evaluation reports: the mean over data-parallel ranks (one all-reduce),
        so every rank takes the same decisions (NaN guard, rollback)."""
        return global_mean(loss, dims, device)

    def rollback_after(self, configured: int) -> int:
        """Non-finite steps in a row before rolling back to the last checkpoint (0 = never)."""
        return configured

    def after_step(self, step: int) -> bool:
        """Called after every optimizer step; True when it synchronised the replicas."""
        return False

    def finish(self, step: int) -> None:
        """Called once at the end of training, before the final evaluation."""

    def checkpoint_prefix(self, dp_rank: int) -> str:
        """Prefix of this replica's tensor names in a checkpoint ("" = the model's own names)."""
        return ""

    def check_resume(self, path: object, saved_dp_size: int | None, dp_size: int) -> None:
        """Refuse (ValueError) a checkpoint this layout cannot continue exactly."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LowCommSync(ReplicaSync):
    """Call ``after_step(step)`` after every inner optimizer step; it synchronises when ``step % H == 0``."""

    independent = True

    def __init__(self, model: nn.Module, mode: str, sync_every: int, group: dist.ProcessGroup | None = None,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, counter: CommCounter | None = None):
        if mode not in ("local_sgd", "diloco"):
            raise ValueError(f"unknown low-communication mode {mode!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mode, self.sync_every, self.group = mode, sync_every, group
        self.counter = counter if counter is not None else CommCounter()
        self.world = dist.get_world_size(group)
        # No initial averaging: ``parallelize`` initialises every replica from the same seeded reference
        # model, so they already start identical.
        self.outer_opt = None
        if mode == "diloco":
            # Global (outer) weights: an fp32 copy the outer optimizer updates; local params restart from it.
            self.global_params = [p.detach().clone().float() for p in self.params]
            self.outer_opt = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                             nesterov=True)

    def _all_reduce_mean(self, flat: torch.Tensor) -> None:
        self.counter.add(flat)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.world)

    @torch.no_grad()
    def _average_weights(self) -> None:
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self._all_reduce_mean(flat)
        self._unflatten_into(flat, self.params)

    @staticmethod
    def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """Synchronise if ``step`` is a multiple of H; returns True when it did."""
        if step % self.sync_every:
            return False
        if self.mode == "local_sgd":
            self._average_weights()
            return True
        # Pseudo-gradient: how far the global weights are from where the local replica went.
        delta = torch.cat([(g - p.float()).reshape(-1) for g, p in zip(self.global_params, self.params)])
        self._all_reduce_mean(delta)
        offset = 0
        for g in self.global_params:
            g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer_opt.step()
        self.outer_opt.zero_grad(set_to_none=True)
        for p, g in zip(self.params, self.global_params):
            p.copy_(g)
        return True

    def finish(self, step: int) -> None:
        """At the end of training: one last synchronisation unless ``step`` just had one."""
        if step % self.sync_every:
            self.after_step(step - step % self.sync_every + self.sync_every)

    def step_loss(self, loss: torch.Tensor | None, dims: ParallelDims, device: torch.device) -> torch.Tensor:
        """This replica's own loss: no per-step communication at all."""
        return loss.detach().float()

    def rollback_after(self, configured: int) -> int:
        """Never: each replica decides alone (local losses), and a rollback must be taken by all ranks."""
        return 0

    def checkpoint_prefix(self, dp_rank: int) -> str:
        """Replica 0 under the plain names (eval, generate and export read it); the others apart."""
        return f"replica{dp_rank}." if dp_rank > 0 else ""

    def check_resume(self, path: object, saved_dp_size: int | None, dp_size: int) -> None:
        if saved_dp_size != dp_size:
            raise ValueError(f"{path}: low-communication replicas diverge between synchronisations, so this "
                             f"checkpoint of {saved_dp_size} replicas resumes only on as many (now {dp_size})")

    def state_dict(self) -> dict:
        if self.outer_opt is None:
            return {}
        return {"global_params": [g.detach().clone() for g in self.global_params],
                "outer_opt": self.outer_opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.outer_opt is None or not state:
            return
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"]):
                g.copy_(saved)
        self.outer_opt.load_state_dict(state["outer_opt"])
