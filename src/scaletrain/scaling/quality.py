"""What a run buys: the predicted val bpb of a plan from the data's scaling fit, and the searches over it.

- ``predicted_quality``: a model of N non-embedding parameters trained on D tokens -> bpb and its 90% interval,
  and the fitted compute-optimal tokens per parameter at that compute (``scaletrain plan --data``);
- ``cheapest_for_target``: the (model size, tokens, device count) that reaches a bpb for the least money
  (``--target-bpb``): for each size near the compute-optimal one, the tokens the law needs to reach the target,
  then the deadline search's options (``deadline.options``: the fastest plan on every device count, priced);
- ``best_within``: the lowest predicted bpb within a budget and/or a deadline (``--budget`` / ``--deadline``
  with ``--data`` and no model): for each size, the tokens its cheapest qualifying option affords.

Models are members of one width/depth family (``model_for_params``: head_dim 64, about 1 layer per 64 of width),
the shape that the fit's ``N`` (non-embedding parameters) stands for. The law was fitted on one recipe (the
grid's sequence length, batch, schedule and optimizer); its prediction for another batch or sequence length is
an extrapolation (docs/planning.md says which changes invalidate a fit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.data.shards import read_manifest
from scaletrain.hardware.catalog import Cluster
from scaletrain.model.presets import active_params, num_params
from scaletrain.plan.deadline import Option, options
from scaletrain.plan.report import duration
from scaletrain.plan.workload import Workload
from scaletrain.scaling.compare import (
    LADDER_FACTORS,
    TIE,
    FamilySearch,
    compare,
    crossover,
    crossover_lines,
    price,
)
from scaletrain.scaling.family import MoEShape, family_key, family_name, shape_of
from scaletrain.scaling.fit import ScalingFit, check_searchable, check_target, law_params
from scaletrain.scaling.grid import BATCH, MAX_EPOCHS, SEQ_LEN
from scaletrain.scaling.store import fitted_flops

SIZE_FACTORS = (0.5, 1.0, 2.0)  # sizes tried around the compute-optimal one
SIZES_WITHIN = 7  # sizes tried for --budget / --deadline, log-spaced
# The searches price data-parallel plans (DDP / ZeRO / FSDP, micro-batch, recomputation): a 4-30x smaller plan
# space than with TP / PP / CP, which the family's sizes rarely need; `plan --model.preset` prices those for one size.
PINS = {"tp": 1, "pp": 1, "cp": 1}
SMALLER, LARGER = 0.1, 100.0  # the sizes a fit is used for, relative to its grid's smallest and largest


def predicted_quality(fit: ScalingFit, params: float, tokens: float) -> dict:
    """bpb, its interval and the compute-optimal tokens per parameter at this run's compute (C = 6 N D)."""
    mid, lo, hi = fit.predict(params, tokens)
    flops = 6.0 * params * tokens
    return {"val_bpb": mid, "interval": [lo, hi], "params_non_embedding": params, "tokens": tokens, "flops": flops,
            "tokens_per_param": tokens / params, "optimal_tokens_per_param": fit.tokens_per_param(flops)}


def quality_text(q: dict) -> str:
    return (f"predicted val bpb {q['val_bpb']:.4f} [90%: {q['interval'][0]:.4f}, {q['interval'][1]:.4f}] for "
            f"{q['params_non_embedding']:,.0f} non-embedding parameters on {q['tokens']:,.0f} tokens "
            f"({q['tokens_per_param']:.1f} tokens per parameter; compute-optimal at {q['flops']:.3g} FLOPs on this "
            f"data: {q['optimal_tokens_per_param']:.1f} tokens per parameter, Chinchilla's 20 is a convention)")


def model_for_params(target: float, vocab_size: int, max_seq_len: int, low: float = 0.0,
                     high: float = math.inf, moe: MoEShape | None = None) -> ModelConfig:
    """The family member whose non-embedding parameters are closest to ``target`` (log scale): widths in steps
    of 16 (head_dim 16 below 128, 64 from there), about one layer per 64 of width (at least 2; half and double
    that depth are tried too, for sizes between two widths); only members within [``low``, ``high``] (a fit's
    scope: the nearest member could otherwise be a size the fit may not speak for) when one is. ``moe``: the
    members of that mixture-of-experts family (scaling/family.py), N counting their active parameters."""
    best, best_gap = None, math.inf
    for dim in (*range(16, 128, 16), *range(128, 16385, 64)):
        n_layers = max(2, round(dim / 64))
        for layers in {n_layers, max(1, n_layers // 2), 2 * n_layers}:
            cfg = ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=layers,
                              n_heads=dim // 16 if dim < 128 else dim // 64, ffn_hidden_dim=0, multiple_of=16,
                              max_seq_len=max_seq_len)
            cfg = cfg if moe is None else moe.apply(cfg)
            params = law_params(cfg)
            gap = abs(math.log(params / target)) + (0.0 if low <= params <= high else 1e3)  # outside: last resort
            if gap < best_gap:
                best, best_gap = cfg, gap
    return best


def tokens_for_target(fit: ScalingFit, params: float, target: float) -> float | None:
    """D with L(N, D) = target, or None when this N cannot reach it with any D."""
    p = fit.params
    room = target - p.E - p.A / params ** p.alpha
    return (p.B / room) ** (1.0 / p.beta) if room > 0 else None


def _priced(workload: Workload, cluster: Cluster, pins: dict, prices: dict, as_of: str, max_nodes: int
            ) -> list[Option]:
    return options(workload, cluster, pins, prices, as_of, max_nodes)


def _row(fit: ScalingFit, model: ModelConfig, tokens: float, option: Option) -> dict:
    n = law_params(model)
    shape = {"dim": model.dim, "n_layers": model.n_layers, "n_heads": model.n_heads}
    if model.moe_experts:
        shape.update(moe_experts=model.moe_experts, moe_top_k=model.moe_top_k, moe_hidden_dim=model.moe_hidden_dim)
    return {"model": shape, "family": family_key(model), "parameters": num_params(model),
            "active_parameters": active_params(model), **predicted_quality(fit, n, tokens), **option.as_dict()}


@dataclass(frozen=True)
class Scope:
    """Where a fit may be used: sizes from ``SMALLER`` x its smallest to ``LARGER`` x its largest model, and at
    most ``MAX_EPOCHS`` epochs of the data's training split (the grid's own limit; more repeats change the law)."""

    n_low: float
    n_high: float
    max_tokens: float

    @classmethod
    def of(cls, fit_doc: dict, train_tokens: int) -> Scope:
        sizes = [r["params"] for r in fit_doc.get("runs", [])] or [1e5]
        return cls(min(sizes) * SMALLER, max(sizes) * LARGER, MAX_EPOCHS * float(train_tokens))

    def describe(self) -> str:
        return (f"{self.n_low:,.0f} to {self.n_high:,.0f} non-embedding parameters and at most "
                f"{self.max_tokens:,.0f} tokens ({MAX_EPOCHS} epochs of this data)")

    def outside(self, params: float, tokens: float) -> list[str]:
        """Why one run of ``params`` non-embedding parameters on ``tokens`` lies outside the scope (empty: it
        does not); ``plan --data --model.preset`` prints these beside its prediction, which it still makes."""
        notes = []
        if tokens > self.max_tokens:
            epochs = tokens / (self.max_tokens / MAX_EPOCHS)
            notes.append(f"{tokens:,.0f} tokens are {epochs:,.1f} epochs of this data's training split, and the "
                         f"fit's scope ends at {MAX_EPOCHS} (more repeats change the law: Muennighoff et al. "
                         f"2023): the prediction is an extrapolation the fit cannot make; prepare more data")
        if not self.n_low <= params <= self.n_high:
            notes.append(f"{params:,.0f} non-embedding parameters are outside the fit's sizes ({self.n_low:,.0f} "
                         f"to {self.n_high:,.0f}: 0.1x its smallest to 100x its largest model): the prediction is "
                         f"an extrapolation the fit cannot make")
        return notes


def cheapest_for_target(fit: ScalingFit, target: float, scope: Scope, vocab_size: int, cluster: Cluster,
                        seq_len: int, global_batch: int, precision: str, pins: dict, prices: dict, as_of: str,
                        max_nodes: int, moe: MoEShape | None = None,
                        factors: tuple[float, ...] = SIZE_FACTORS) -> dict:
    """The cheapest (on-demand) size, tokens and device count predicted to reach ``target`` bpb (``moe``: among
    that mixture-of-experts family's members, ``fit`` being its law), over ``factors`` x the compute-optimal
    size."""
    check_target(fit, target)
    n_opt = _optimal_params_for_target(fit, target, scope)
    if not n_opt:
        raise ConfigError(f"no model within the fit's scope ({scope.describe()}) is predicted to reach {target:g} "
                          f"bpb; aim higher, or prepare more data and fit again")
    rows = []
    for factor in factors:
        model = model_for_params(min(max(n_opt * factor, scope.n_low), scope.n_high), vocab_size, seq_len,
                                 scope.n_low, scope.n_high, moe)
        n = law_params(model)
        tokens = tokens_for_target(fit, n, target)
        if tokens is None or tokens > scope.max_tokens:
            continue
        tokens = max(tokens, float(global_batch * seq_len))  # at least one step (it may overshoot the target)
        if tokens > scope.max_tokens:
            continue
        workload = Workload(model, seq_len, global_batch, tokens, precision)
        opts = _priced(workload, cluster, pins, prices, as_of, max_nodes)
        if opts:
            rows.append(_row(fit, model, tokens, min(opts, key=lambda o: (o.cost.on_demand_usd, o.hours))))
    if not rows:
        raise ConfigError(f"no model of the family fits {cluster.hardware.name} at the size that reaches "
                          f"{target:g} bpb; try other --hardware or a higher --max-nodes")
    return {"target_bpb": target, "candidates": rows, "choice": min(rows, key=lambda r: r["on_demand_usd"])}


def _optimal_params_for_target(fit: ScalingFit, target: float, scope: Scope) -> float:
    """N minimising the compute 6 N D(N) that reaches ``target`` within ``scope`` (a log-spaced scan); 0: none."""
    best_n, best_c = 0.0, math.inf
    for n in np.logspace(math.log10(scope.n_low), math.log10(scope.n_high), 201):
        d = tokens_for_target(fit, n, target)
        if d is not None and d <= scope.max_tokens and n * d < best_c:
            best_n, best_c = n, n * d
    return best_n


def best_within(fit: ScalingFit, scope: Scope, vocab_size: int, cluster: Cluster, seq_len: int, global_batch: int,
                precision: str, pins: dict, prices: dict, as_of: str, max_nodes: int, budget_usd: float | None,
                deadline_h: float | None, moe: MoEShape | None = None) -> dict:
    """The lowest predicted bpb within the budget (on-demand USD) and/or deadline (hours) over sizes and device
    counts; cost and time are linear in the tokens, so each option affords tokens = limit / (cost per token)."""
    probe_tokens = 1e9
    rows = []
    for n in np.logspace(math.log10(scope.n_low), math.log10(scope.n_high), SIZES_WITHIN):  # within the scope
        model = model_for_params(n, vocab_size, seq_len, scope.n_low, scope.n_high, moe)
        workload = Workload(model, seq_len, global_batch, probe_tokens, precision)
        for option in _priced(workload, cluster, pins, prices, as_of, max_nodes):
            limits = [probe_tokens * budget_usd / option.cost.on_demand_usd] if budget_usd else []
            limits += [probe_tokens * deadline_h / option.hours] if deadline_h else []
            tokens = min([*limits, scope.max_tokens])
            if tokens < global_batch * seq_len:
                continue
            scaled = _scaled(option, tokens / probe_tokens)
            rows.append(_row(fit, model, tokens, scaled))
    if not rows:
        raise ConfigError("no size and device count trains even one step within the limits; raise --budget or "
                          "--deadline")
    best: dict = {}
    for r in rows:  # per size, the option with the lowest bpb; then the lowest overall
        key = r["params_non_embedding"]
        if key not in best or r["val_bpb"] < best[key]["val_bpb"]:
            best[key] = r
    table = sorted(best.values(), key=lambda r: r["params_non_embedding"])
    return {"budget_usd": budget_usd, "deadline_hours": deadline_h, "candidates": table,
            "choice": min(table, key=lambda r: r["val_bpb"])}


def _scaled(option: Option, factor: float) -> Option:
    """The option for ``factor`` times the tokens: hours and dollars scale, the plan does not."""
    from dataclasses import replace

    cost = replace(option.cost, device_hours=option.cost.device_hours * factor,
                   on_demand_usd=option.cost.on_demand_usd * factor, spot_usd=option.cost.spot_usd * factor)
    return replace(option, hours=option.hours * factor, cost=cost)


# -- `scaletrain plan --data / --target-bpb`: the command-line side ------------------------------------------------
def add_quality_arguments(parser) -> None:
    """``--data`` and ``--target-bpb`` (``--budget`` / ``--deadline`` are the deadline search's)."""
    q = parser.add_argument_group("quality (a scaling fit of the data: `scaletrain scale`)")
    q.add_argument("--data", default="", help="a prepared data folder with a scaling_fit.json: every plan prints its "
                                              "predicted val bpb; with --budget/--deadline and no model, the lowest "
                                              "predicted bpb within them")
    q.add_argument("--target-bpb", type=float, default=None,
                   help="the cheapest model size, tokens and device count predicted to reach this val bpb (--data)")


def quality_search(args, fits: dict[str, tuple[ScalingFit, dict]], vocab: int, cluster: Cluster, prices: dict,
                   as_of: str, precision: str, console, *, model_given: bool, seq_len: int | None) -> dict | None:
    """``--target-bpb`` or ``--budget``/``--deadline`` without a model (``model_given``: a --config or
    --model.* flags): search and print; the result, or None when the plan is the ordinary one (``--data`` only adds
    the predicted bpb to it). ``fits``: the data's fits by family (scaling/family.py), each searched; with more
    than one, the cheaper family (the lower bpb within a budget) is the choice and, for a target, the crossover
    is searched (scaling/compare.py). ``seq_len``: a --data.seq_len flag, else the fit's own."""
    wants_search = args.target_bpb is not None or (not model_given and
                                                    (args.budget is not None or args.deadline is not None))
    if not fits or not wants_search:
        return None
    searches, results, refusals = [], {}, {}
    for key, (fit, doc) in fits.items():
        check_searchable(fit, fitted_flops(doc.get("runs", [])))
        # The fit's own sequence and batch on every hardware: the law was measured at that many tokens a step,
        # and a GPU's usual ~0.5M-token step would reach the same tokens in a few hundred times fewer optimizer
        # steps (7.3M tokens were 14 such steps), far above the small grid's critical batch.
        recipe = doc.get("recipe", {})
        seq = seq_len or int(recipe.get("seq_len", SEQ_LEN))
        batch = args.global_batch or int(recipe.get("batch", BATCH))
        search = FamilySearch(key, fit, doc, Scope.of(doc, train_tokens(args.data)),
                              (vocab, cluster, seq, batch, precision, PINS, prices, as_of, args.max_nodes),
                              cheapest_for_target)
        try:
            results[key] = _search_one(args, search, console, titled=len(fits) > 1)
        except ConfigError as exc:
            if len(fits) == 1:
                raise
            refusals[key] = str(exc)
            console.print(f"{family_name(key)}: {exc}")
            continue
        searches.append(search)
    if not results:
        raise ConfigError("; ".join(f"{family_name(k)}: {why}" for k, why in refusals.items()))
    if len(fits) == 1:
        return next(iter(results.values()))
    return _families_choice(args, searches, results, refusals, cluster, console)


def _search_one(args, search, console, titled: bool) -> dict:
    """One family's search, printed as before (its table, choice, scope and caveats)."""
    fit, doc, scope, moe = search.fit, search.doc, search.scope, shape_of(search.key)
    cluster, seq, batch = search.common[1:4]
    of = f" with {family_name(search.key)} models" if titled else ""
    if args.target_bpb is not None:
        # families compared: the crossover ladder's finer sizes, so the verdict and the ladder price alike
        factors = LADDER_FACTORS if titled else SIZE_FACTORS
        result = cheapest_for_target(fit, args.target_bpb, scope, *search.common, moe=moe, factors=factors)
        title = f"the cheapest way to reach {args.target_bpb:g} bpb{of}"
    else:
        result = best_within(fit, scope, *search.common, args.budget, args.deadline, moe=moe)
        title = "the lowest predicted bpb within " + " and ".join(
            ([f"${args.budget:,.0f}"] if args.budget else []) + ([f"{args.deadline:g} h"] if args.deadline else []))
        title += of
    print_quality(console, result, title, cluster, search.common[7], seq, batch)
    console.print(f"searched within the fit's scope: {scope.describe()}")
    print_fit_caveats((fit, doc), console)
    drift = recipe_drift(doc.get("recipe", {}), seq, batch)
    if drift:
        console.print(drift)
    return {**result, "family": search.key,
            "scope": {"n_low": scope.n_low, "n_high": scope.n_high, "max_tokens": scope.max_tokens}}


def _families_choice(args, searches, results: dict, refusals: dict, cluster: Cluster, console) -> dict:
    """Dense or MoE: the cheaper family's choice for a target (and the crossover), the lower bpb within limits."""
    if args.target_bpb is not None:
        verdict = compare(results)
        best = verdict["family"]
        others = ", ".join(f"{family_name(k)} {_money(price(results[k]), results[k])} ({r:.2f}x)"
                           for k, r in verdict["ratios"].items())
        tie = bool(verdict["ratios"]) and min(verdict["ratios"].values()) <= 1 + TIE
        verdict["tie"] = tie
        console.print(f"dense or MoE: {family_name(best)} reaches {args.target_bpb:g} bpb cheapest, "
                      f"{_money(price(results[best]), results[best])}; {others or 'no other family reaches it'}"
                      + (f": a tie (within {TIE:.0%}, as the family's size steps move a cost)" if tie else ""))
        cross = crossover(searches)
        for line in crossover_lines(cross, cluster.hardware.name):
            console.print(line)
    else:
        best = min(results, key=lambda k: results[k]["choice"]["val_bpb"])
        console.print(f"dense or MoE: {family_name(best)} buys the lowest predicted bpb within the limits, "
                      f"{results[best]['choice']['val_bpb']:.4f}")
        cross = None
    return {**results[best], "families": results, "refused": refusals, "crossover": cross,
            "tie": bool(args.target_bpb is not None and verdict["tie"])}


def _money(value: float, result: dict) -> str:
    """A family's price as ``compare.price`` counts it (dollars, or hours when the price table has none)."""
    return _usd(value) if result["choice"]["on_demand_usd"] > 0 else duration(value * 3600)


def train_tokens(data_dir: str) -> int:
    """The training split's tokens of a prepared data folder (a fit's scope is counted in its epochs)."""
    return int(read_manifest(data_dir, verify=False)["splits"]["train"]["tokens"])


def print_prediction(fit_doc: tuple[ScalingFit, dict], data_dir: str, params: float, tokens: float,
                     console) -> None:
    """``plan --data`` beside a planned run: its predicted bpb, what of it lies outside the fit's scope (more
    epochs of the data than the grid's, a size far from its models) and the fit's own caveats."""
    console.print(quality_text(predicted_quality(fit_doc[0], params, tokens)))
    for note in Scope.of(fit_doc[1], train_tokens(data_dir)).outside(params, tokens):
        console.print(f"caveat: {note}")
    print_fit_caveats(fit_doc, console)


def print_fit_caveats(fit_doc: tuple[ScalingFit, dict], console) -> None:
    """The caveats ``scale`` printed with the fit, again beside every prediction made from it: a term the grid
    barely constrained is where held-out runs missed (a Tiny Shakespeare char grid's flat size term: predictions
    3.8-6.3% pessimistic at 4x-16x, docs/planning.md), so a plan read days later says so too."""
    fit, doc = fit_doc
    for note in fit.caveats(fitted_flops(doc.get("runs", []))):
        console.print(f"caveat (the fit): {note}")


def recipe_drift(recipe: dict, seq: int, batch: int) -> str:
    """A caveat when --data.seq_len/--global-batch move the tokens a step away from the fit's (0.5x-2x is kept quiet:
    the loss is flat in the batch near the critical size); empty when they match."""
    fitted = int(recipe.get("seq_len", 0)) * int(recipe.get("batch", 0))
    if not fitted or 0.5 <= seq * batch / fitted <= 2.0:
        return ""
    return (f"caveat: {seq * batch:,} tokens a step, the fit's runs took {fitted:,} (seq {recipe['seq_len']} x "
            f"{recipe['batch']}): the predicted bpb assumes a token buys the same loss at either batch, which holds "
            f"only below the critical batch size; fewer, larger steps usually reach a higher loss")


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 else f"${x:.2g}"


def print_quality(console, result: dict, title: str, cluster: Cluster, as_of: str, seq: int, batch: int) -> None:
    from rich.table import Table

    table = Table(title=f"{title} on {cluster.hardware.name} (seq {seq}, {batch} sequences a step; prices as of "
                        f"{as_of})")
    for col in ("N (non-emb)", "dim x layers", "tokens", "tok/param", "devices", "time", "on-demand $",
                "predicted bpb [90%]"):
        table.add_column(col)
    for r in result["candidates"]:
        table.add_row(f"{r['params_non_embedding']:,.0f}", f"{r['model']['dim']} x {r['model']['n_layers']}",
                      f"{r['tokens']:,.3g}", f"{r['tokens_per_param']:.1f}", str(r["devices"]),
                      duration(r["hours"] * 3600), _usd(r["on_demand_usd"]),
                      f"{r['val_bpb']:.4f} [{r['interval'][0]:.4f}, {r['interval'][1]:.4f}]")
    console.print(table)
    c = result["choice"]
    reach = f"reaches {result['target_bpb']:g} bpb" if "target_bpb" in result else "is the best within the limits"
    console.print(f"choice: {c['model']['dim']} x {c['model']['n_layers']} ({c['params_non_embedding']:,.0f} "
                  f"non-embedding, {c['parameters']:,} total parameters) on {c['tokens']:,.0f} tokens, "
                  f"{c['devices']} device(s), {c['plan']}: {duration(c['hours'] * 3600)}, "
                  f"{_usd(c['on_demand_usd'])} on demand ({_usd(c['spot_usd'])} spot); {reach}")
    console.print(quality_text(c))
