"""Present a plan: the readable tables (rich) and the JSON document (same numbers)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from scaletrain.core.files import human_bytes
from scaletrain.hardware.allocator import launch_note
from scaletrain.hardware.catalog import Cluster
from scaletrain.model.presets import active_params
from scaletrain.plan.cost import Cost
from scaletrain.plan.search import Candidate, SearchResult
from scaletrain.plan.timing import DTYPE_OF_PRECISION, workload_utilisation
from scaletrain.plan.wall import Wall
from scaletrain.plan.workload import CHINCHILLA_TOKENS_PER_PARAM, Workload
from scaletrain.train.optimizer import OPTIMIZERS

FLOPS_FORMULA = ("6 * N_matmul + 12 * n_layers * seq_len * dim per token (forward + backward = 3x forward; "
                 "N_matmul = weights of every matmul incl. the output head, not the embedding lookup; attention "
                 "QK^T and AV not halved for the causal mask, as PaLM / nanoGPT / torchtitan; "
                 "recomputation not counted)")


# SI prefixes from kilo (1e3) to quetta (1e30): training FLOPs pass 1e21 (zetta) at GPT-3 scale.
SI_PREFIXES = "kMGTPEZYRQ"


def human(x: float, unit: str = "") -> str:
    """1234567 -> '1.23M', 9.3e21 -> '9.3Z' (SI prefixes, 3 significant digits); beyond the largest prefix
    scientific, '1.5e+33'. Rounded before the prefix is picked, so 999_999 is '1M', never '1e+03k'."""
    rounded = float(f"{x:.3g}") if math.isfinite(x) else x
    power = 0  # of 1000; compared, not log10'd, so that 1e21 is never 999.99...E
    while power < len(SI_PREFIXES) and abs(rounded) >= 1000.0 ** (power + 1):
        power += 1
    if power == 0 or abs(rounded) >= 1000.0 ** (len(SI_PREFIXES) + 1):
        return f"{rounded:.3g}{unit}"
    return f"{rounded / 1000.0 ** power:.3g}{SI_PREFIXES[power - 1]}{unit}"


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**28 else f"{x / 2**20:.1f} MiB"


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def workload_dict(w: Workload, chinchilla: bool) -> dict:
    return {
        "params_total": w.params, "params_non_embedding": w.params_non_embedding,
        "params_active": active_params(w.model), "vocab_size": w.model.vocab_size,
        "flops_per_token": w.flops_per_token, "flops_formula": FLOPS_FORMULA,
        "seq_len": w.seq_len, "global_batch_sequences": w.global_batch, "tokens_per_step": w.tokens_per_step,
        "train_tokens": w.train_tokens, "steps": w.steps, "total_flops": w.total_flops, "precision": w.precision,
        "optimizer": w.optimizer,
        "tokens_convention": (f"Chinchilla-optimal: {CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter (a convention "
                              f"rounding Hoffmann et al. 2022)" if chinchilla else "given"),
    }


def optimizer_text(w: Workload) -> str:
    """The planned optimizer in words, for the tables."""
    adapters = ", LoRA's lora_A / lora_B too" if w.muon_adapters else ""
    return f"{w.optimizer} ({w.optimizer_entry.summary.format(adapters=adapters)})"


def plan_dict(c: Candidate, w: Workload, cost: Cost | None, wall: Wall | None = None) -> dict:
    """A ranked plan as JSON: ``total_seconds`` is the whole wall (``wall``: steps, evaluation, samples and
    checkpoints, as the trainer's done line counts them), else the steps alone."""
    out = c.as_dict()
    if c.time:
        out["total_seconds"] = wall.total if wall is not None else c.time.step * w.steps
    if wall is not None:
        out["wall"] = wall.as_dict()
    if cost:
        out["cost"] = cost.as_dict()
    return out


def wall_text(wall: Wall) -> str:
    """'wall 4.2 min = steps 4.0 min + evaluation 6.9 s (7 x 20 batches of 49.3 ms) + samples 561.1 ms +
    checkpoints 676.0 ms (3 x 9.7 MB)': the parts the trainer's ``done:`` line counts."""
    return (f"wall {duration(wall.total)} = steps {duration(wall.steps)} + evaluation {duration(wall.evaluation)} "
            f"({wall.evaluations} x {wall.eval_batches} batches of {duration(wall.eval_batch_seconds)}) + samples "
            f"{duration(wall.samples)} + checkpoints {duration(wall.checkpoints)} ({wall.checkpoint_count} x "
            f"{human_bytes(wall.checkpoint_bytes)}): eval/sample/checkpoint {wall.stall_share:.1%} of it, as "
            f"`train`'s done line counts them")


def print_report(console: Console, w: Workload, cluster: Cluster, result: SearchResult, costs: list[Cost],
                 chinchilla: bool, top: int, walls: list[Wall] | None = None) -> None:
    """Summary, ranked plans (``walls``: each one's whole wall), the winner's memory and time breakdown and its
    wall, and a few rejected plans with why."""
    hw = cluster.hardware
    summary = Table(title=f"Workload on {cluster.describe()}", show_header=False)
    summary.add_row("parameters", f"{human(w.params)} total, {human(w.params_non_embedding)} non-embedding"
                    + (f", {human(active_params(w.model))} active a token (top-{w.model.moe_top_k} of "
                       f"{w.model.moe_experts} experts)" if w.model.moe_experts else ""))
    summary.add_row("FLOPs / token", f"{human(w.flops_per_token)}  [{FLOPS_FORMULA.split(' per token')[0]}]")
    summary.add_row("tokens", f"{human(w.train_tokens)}"
                    + (f"  (Chinchilla-optimal: {CHINCHILLA_TOKENS_PER_PARAM}/param, a convention)"
                       if chinchilla else ""))
    summary.add_row("batch", f"{w.global_batch} x {w.seq_len} = {human(w.tokens_per_step)} tokens/step, "
                             f"{w.steps:,} steps")
    summary.add_row("total FLOPs", human(w.total_flops))
    summary.add_row("precision", f"{w.precision}; compute at {human(hw.flops(_dtype(w)), 'FLOP/s')} peak x "
                                 f"{workload_utilisation(w, hw):.2f} utilisation")
    summary.add_row("utilisation source", hw.utilisation_source)
    summary.add_row("optimizer", optimizer_text(w))
    if hw.kind == "cpu" and cluster.world_size > 1 and "comm_source" in hw.calibration:
        summary.add_row("collectives", hw.calibration["comm_source"])
    if hw.kind == "cpu" and hw.name.startswith("auto"):  # the allocator decides the margin of a CPU's memory
        summary.add_row("malloc", launch_note(cluster.world_size))
    console.print(summary)

    table = Table(title=f"Top plans (of {result.considered} considered, {len(result.ranked)} fit)")
    for col in ("#", "plan", "mem/device", "tokens/s", "step", "MFU", "wall time", "device-h", "on-demand $",
                "spot $"):
        table.add_column(col, no_wrap=col == "plan")
    for i, (c, cost) in enumerate(zip(result.ranked[:top], costs)):
        table.add_row(str(i + 1), c.plan.label(), gib(c.memory.total), human(c.time.tokens_per_second),
                      duration(c.time.step), mfu_text(c.time.mfu),
                      duration(walls[i].total if walls else c.time.step * w.steps),
                      f"{cost.device_hours:,.1f}", _money(cost.on_demand_usd), _money(cost.spot_usd))
    console.print(table)
    for i, c in enumerate(result.ranked[:top]):
        console.print(f"  #{i + 1} {c.plan.label()}: {c.reason}")
    if result.ranked:
        best = result.ranked[0]
        console.print(breakdown_table(best, w.optimizer))
        if walls:
            console.print(f"plan #1 {wall_text(walls[0])}")
        if costs:
            console.print(f"prices: {costs[0].price_on_demand:.2f} $/h on-demand, {costs[0].price_spot:.2f} $/h spot "
                          f"(table of {costs[0].prices_as_of}: {costs[0].price_source})")
    if result.rejected:
        rej = Table(title="Closest plans that do not fit")
        rej.add_column("plan")
        rej.add_column("why not")
        for c in result.rejected[:3]:
            rej.add_row(c.plan.label(), c.reason)
        console.print(rej)


def mfu_text(mfu: float) -> str:
    """MFU as a percentage; above 100% it cannot be (the peak it divides by was measured too low): say so."""
    return f"{mfu:.0%}" if mfu <= 1.0 else "n/a (peak measured too low: rerun `scaletrain doctor`)"


def _money(x: float) -> str:
    return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"


def breakdown_table(c: Candidate, optimizer: str = "adamw") -> Table:
    """The best plan's memory at its peak and its step time, part by part."""
    m, t = c.memory, c.time
    states = f"optimizer states ({OPTIMIZERS[optimizer].states_label})"
    table = Table(title=f"Plan #1 ({c.plan.label()}): memory per device at its peak ({m.peak_phase}) and step time")
    table.add_column("memory")
    table.add_column("bytes", justify="right")
    table.add_column("time")
    table.add_column("seconds", justify="right")
    # At a forward or loss peak no gradient exists yet: say so rather than print a bare 0.
    grads = "gradients (none yet at this peak)" if not m.grads and "block" not in m.peak_phase and \
        "optimizer" not in m.peak_phase else "gradients"
    mem_rows = [("parameters", m.params), (grads, m.grads), (states, m.optimizer),
                ("fp32 master weights", m.master), ("activations (saved)", m.activations),
                ("transients (logits, backward temps)", m.transients), ("communication buffers", m.comm_buffers),
                *([("gloo's buffers (kept by malloc)", m.gloo_buffers)] if m.gloo_buffers else []),
                ("allocator margin", m.allocator_margin), ("runtime (context, libraries)", m.runtime),
                ("total", m.total)]
    time_rows = [("compute (fwd + bwd + recompute)", t.compute), ("optimizer step", t.optimizer)] + (
        [("  of which Newton-Schulz (Muon)", t.newton_schulz)] if t.newton_schulz else []) + [
                 ("pipeline bubble", t.bubble)] + [(f"comm {k} (total)", v) for k, v in t.comm_detail.items()] + [
                 ("comm exposed", t.comm_exposed), ("step", t.step)]
    for i in range(max(len(mem_rows), len(time_rows))):
        a = mem_rows[i] if i < len(mem_rows) else ("", None)
        b = time_rows[i] if i < len(time_rows) else ("", None)
        table.add_row(a[0], gib(a[1]) if a[1] is not None else "", b[0], f"{b[1]:.4g}" if b[1] is not None else "")
    return table


def _dtype(w: Workload) -> str:

    return DTYPE_OF_PRECISION[w.precision]
