"""bench/islands.py's results: the JSON summary of every group and configuration, and the tables printed from it."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pathways_torch as pw
from bench.common import print_table
from bench.islands_link import expected_link_bytes, modelled_link_s
from bench.islands_setups import describe_link
from bench.train_setup import make_model

TARGET = 0.97              # 1 + 1 islands relayed unshaped vs one island of 2 (the paper's 97.2 %)
LOSS_TOLERANCE = 1e-5      # |loss(islands) - loss(one island)| at the same step


def spread(values: list[float]) -> dict:
    """Median, min and max (NaN when empty)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_ratios(rounds: list[dict], key: str, reference: str) -> list[float]:
    """Per round: tokens/s of ``key`` / tokens/s of ``reference`` (rounds where both ran)."""
    return [r[key] / r[reference] for r in rounds if key in r and reference in r and r[reference]]


def loss_difference(losses: dict, reference: dict) -> tuple[float | None, int]:
    """Largest |loss - reference loss| at the steps both recorded, and how many such steps."""
    common = sorted(set(losses) & set(reference))
    if not common:
        return None, 0
    return max(abs(losses[i] - reference[i]) for i in common), len(common)


def summarize(measured: dict, args, rates: dict) -> dict:
    """The JSON payload: per group, per configuration, everything the tables print (``rates``: `relay_rate`
    of each relayed configuration's link, by key)."""
    runs, cfg = measured["runs"], measured["cfg"]
    groups = []
    for group in measured["groups"]:
        reference = runs[group["reference"]]
        configs = {}
        for key in group["keys"]:
            run, setup = runs[key], runs[key].setup
            ratios = round_ratios(group["rounds"], key, group["reference"])
            diff, common = loss_difference(run.losses, reference.losses)
            theory = expected_link_bytes(setup.num_islands, run.gradient_bytes) if setup.islands else None
            entry = {**run.summary(group["name"]), "setup": {
                "executors": setup.num_executors, "islands": setup.islands, "mesh": setup.mesh_axes(),
                "link": None if setup.link is None else dataclasses.asdict(setup.link)},
                "vs_one_island": spread(ratios), "ratios": ratios,
                "first_step_s": run.first_step_s, "context_start_s": run.start_s,
                "gradient_bytes": run.gradient_bytes, "theory_link_bytes_per_step": theory,
                "last_loss": run.losses[max(run.losses)] if run.losses else None,
                "loss_difference": diff, "loss_steps_compared": common,
                "executor_rss_mb": run.rss_mb,
                "in_island_collectives_ms_per_step": (statistics.median(run.collective_s[group["name"]]) * 1e3
                                                      if run.collective_s.get(group["name"]) else None),
                "compute_ms_per_step": {k: v * 1e3 for k, v in run.compute_s.get(group["name"], {}).items()},
                "relay_rate_bytes_per_s": rates.get(key), "link_in_force": run.shaping}
            if setup.islands is not None:
                steps = run.exchange.get(group["name"], [])
                entry["exchange"] = {
                    "steps": len(steps),
                    "wait_ms": spread([s["wait"] * 1e3 for s in steps]),
                    "max_wait_ms": spread([s["max_wait"] * 1e3 for s in steps]),
                    "skew_ms": spread([s["skew"] * 1e3 for s in steps]),
                    "after_last_grads_ms": spread([s["after_last"] * 1e3 for s in steps]),
                    "compute_inside_wait_ms": sum(s["compute_inside"] for s in steps) * 1e3,
                    "hidden_share": (sum(s["compute_inside"] for s in steps) / sum(s["wait"] for s in steps)
                                     if steps and sum(s["wait"] for s in steps) else 0.0),
                    "link_transfer_ms": spread([t * 1e3 for t in run.transfers_s.get(group["name"], [])]),
                    "buckets": run.num_buckets,
                    "transfer_s": run.overlap_s.get(group["name"], [0.0, 0.0])[1],
                    "transfer_hidden_share": (run.overlap_s[group["name"]][0] / run.overlap_s[group["name"]][1]
                                              if run.overlap_s.get(group["name"], [0, 0])[1] else 0.0),
                    "per_step_wait_ms": [s["wait"] * 1e3 for s in steps]}
            configs[key] = entry
        groups.append({"name": group["name"], "kind": group["kind"], "reference": group["reference"],
                       "keys": group["keys"], "rounds": group["rounds"], "wall_s": group["wall_s"],
                       "configs": configs})
    some = next(iter(runs.values()))
    return {"backend": some.backend, "parameters": sum(p.numel() for p in make_model(cfg)[0].parameters()),
            "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                       "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch, "steps": args.steps,
                       "warmup": args.warmup, "rounds": args.rounds, "tokens_per_step": args.batch * cfg.context},
            "groups": groups}


# ------------------------------------------------------------ report

def _ratio(r: dict) -> str:
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def _ms(r: dict) -> str:
    return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"


def _bytes(c: dict) -> str:
    measured, theory = c["link_bytes_per_step"], c["theory_link_bytes_per_step"]
    if measured is None:
        return "- (no relay)" if theory else "-"
    return f"{measured:,.0f} / {theory:,} = {measured / theory:.4f}"


def _loss_diff(c: dict, is_reference: bool) -> str:
    if is_reference:
        return "(reference)"
    if c["loss_difference"] is None:
        return "no common step"
    return f"{c['loss_difference']:.1e} ({c['loss_steps_compared']} steps)"


def _main_rows(group: dict, setups: dict) -> list[list]:
    rows = []
    for key in group["keys"]:
        c, setup = group["configs"][key], setups[key]
        exchange = c.get("exchange")
        rows.append([setup.describe(), json.dumps(c["setup"]["mesh"]).replace('"', ""),
                     describe_link(setup.link, setup.islands is not None),
                     f"{c['tokens_per_s']['median']:,.0f}",
                     "1 (reference)" if key == group["reference"] else _ratio(c["vs_one_island"]),
                     f"{c['ms_per_step']:.1f}", _bytes(c),
                     "-" if exchange is None else _ms(exchange["wait_ms"]),
                     "-" if exchange is None else f"{exchange['wait_ms']['median'] / c['ms_per_step']:.1%}",
                     " / ".join(f"{s:.1f}" for s in c["first_step_s"][:1]),
                     f"{c['last_loss']:.6f}", _loss_diff(c, key == group["reference"])])
    return rows


MAIN_HEADERS = ["configuration", "mesh", "link", "tokens/s", "vs one island", "ms/step",
                "link bytes/step measured / I(I-1)G", "exchange wait ms/step", "wait / step", "first step s",
                "last loss", "|loss - one island|"]


def report(summary: dict, setups: dict, args, method: str, why: str) -> None:
    c = summary["config"]
    groups = summary["groups"]
    print()
    print(f"Two islands vs one island of the same size ({summary['backend']}, one thread per process, executors "
          f"pinned): tokens/s = median of {c['rounds']} windows of {c['steps']} steps; vs one island = median "
          f"(min-max) of the per-round ratios to the group's one-island run, rounds interleaved, order rotated")
    print(f"model: {summary['parameters']:,} parameters (width {c['width']}, depth {c['depth']}, heads {c['heads']}), "
          f"context {c['context']}, global batch {c['batch']} = {c['tokens_per_step']:,} tokens/step; "
          f"G = {summary['parameters'] * 4:,} gradient bytes (float32)")
    described = ("contexts of a group kept open together, windows interleaved" if method == "open" else
                 "alternate: each window in a context of its own (opened, warmed up, closed)")
    print(f"method: {described} ({why})")
    for group in groups:
        if group["kind"] == "gated":
            print()
            print("(a) gated: 1 + 1 islands vs one island of 2 executors")
            print_table(MAIN_HEADERS, _main_rows(group, setups))
            ratio = group["configs"]["islands-1+1-relay"]["vs_one_island"]
            direct = group["configs"]["islands-1+1-direct"]["vs_one_island"]
            print(f"target: 1 + 1 islands relayed unshaped >= {TARGET:.2f} x one island (the Pathways paper's 97.2 %): "
                  f"{ratio['median']:.3f} — {'met' if ratio['median'] >= TARGET else 'NOT met'}; "
                  f"direct (no relay): {direct['median']:.3f}")
    for group in groups:
        if group["kind"] == "2x2":
            print()
            print(f"(b) 2 x 2 islands vs one island of 4 executors (reported; {os.cpu_count()} cores for 4 executors "
                  f"and the client: expect noise)")
            print_table(MAIN_HEADERS, _main_rows(group, setups))
    shaped = [g for g in groups if g["kind"] == "shapes"]
    if shaped:
        print()
        print("(c) 1 + 1 islands at several link shapes (each group with its own one-island and unshaped-relay runs "
              "in the same rounds; 'relay alone' = what a LinkRelay of that shape delivers, one loopback connection, "
              "no executors; model = the unshaped relay's ms/step + one-way delay + G / rate (nominal, or the "
              "relay's, less the unshaped relay's own G / rate); 'model vs one island' from the relay's rate)")
        rows = []
        for group in shaped:
            unshaped = group["configs"]["islands-1+1-relay"]
            one = group["configs"][group["reference"]]
            for key in group["keys"]:
                if key == group["reference"]:
                    continue
                c, setup = group["configs"][key], setups[key]
                one_way = run_bytes(c) / 2
                rate, base = c["relay_rate_bytes_per_s"], unshaped["relay_rate_bytes_per_s"]
                nominal_ms = unshaped["ms_per_step"] + modelled_link_s(setup.link, one_way) * 1e3
                # The unshaped relay's own transfer time is in its ms/step already.
                model_ms = (unshaped["ms_per_step"] + (modelled_link_s(setup.link, one_way, rate)
                                                       - modelled_link_s(pw.Link(), one_way, base)) * 1e3)
                exchange = c["exchange"]
                rows.append([group["name"], describe_link(setup.link), f"{rate / 1e6:,.0f}" if rate else "-",
                             f"{c['tokens_per_s']['median']:,.0f}",
                             _ratio(c["vs_one_island"]), f"{c['ms_per_step']:.1f}", f"{nominal_ms:.1f}",
                             f"{model_ms:.1f}",
                             f"{one['ms_per_step'] / model_ms:.3f}", _bytes(c), _ms(exchange["wait_ms"]),
                             _ms(exchange["after_last_grads_ms"]), _loss_diff(c, False)])
        print_table(["group", "link", "relay alone MB/s", "tokens/s", "vs one island", "ms/step",
                     "model ms/step (nominal rate)", "model ms/step (relay's rate)", "model vs one island",
                     "link bytes/step measured / I(I-1)G", "exchange wait ms/step", "of which after last grads",
                     "|loss - one island|"], rows)
        print("one island of 2 in these groups: " + ", ".join(
            f"{g['name']} {g['configs'][g['reference']]['tokens_per_s']['median']:,.0f} tokens/s, "
            f"{g['configs'][g['reference']]['ms_per_step']:.1f} ms/step" for g in shaped))
    print()
    print("The exchange between islands, per timed step, from the executors' trace (median (min-max) over steps; "
          "each step's value the mean over executors)")
    rows = []
    for group in groups:
        for key in group["keys"]:
            c = group["configs"][key]
            setup = setups[key]
            exchange = c.get("exchange")
            collectives = c["in_island_collectives_ms_per_step"]
            compute = c["compute_ms_per_step"]
            spent = " + ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(compute.items(), key=_kind_order))
            if exchange is None:
                rows.append([group["name"], setup.describe(), spent.replace("other", "train_step"), "-", "-", "-",
                             "-", "-", "-", "-", "-", "-", "-", "-" if collectives is None else f"{collectives:.1f}"])
                continue
            rows.append([group["name"], f"{setup.describe()}, {describe_link(setup.link)}", spent, exchange["steps"],
                         _ms(exchange["wait_ms"]), _ms(exchange["max_wait_ms"]), _ms(exchange["skew_ms"]),
                         _ms(exchange["after_last_grads_ms"]), _ms(exchange["link_transfer_ms"]),
                         f"{exchange['compute_inside_wait_ms']:.1f}", f"{exchange['hidden_share']:.0%}",
                         exchange["buckets"], f"{exchange['transfer_hidden_share']:.0%}",
                         "-" if collectives is None else f"{collectives:.1f}"])
    print_table(["group", "configuration", "compute ms/step (per executor)", "steps",
                 "wait ms (grads end -> update start)", "slowest executor's wait",
                 "waiting for the other island's grads", "after the last island's grads", "link transfer ms",
                 "compute inside the waits ms (total)", "wait hidden behind compute", "buckets",
                 "link transfer time hidden behind the receiver's compute", "in-island collectives ms/step"],
                rows)
    print("notes: compute = the executors' compute spans per step (one island's train_step holds its all-reduce, "
          "the last column; the islands' grads — the backward cut per bucket, one span per bucket — hold their "
          "in-island reduce-scatters); each bucket's slice leaves when its segment ends, so the exchange of the first "
          "buckets runs during the backward of the rest; 'link transfer time hidden' = the share of the link "
          "transfers' send-to-receipt time during which the receiving executor was still computing (the last "
          "bucket's transfer, after the backward, cannot be hidden); 'wait' = what was not hidden: the last grads "
          "segment's end to the update's start; "
          "'link transfer' = send to receipt of each transfer between islands (both the gradient slices and the "
          "losses); link bytes: every byte the relay wrote (both directions) over the timed steps, against "
          "I(I-1)G = each of the I x D executors sending its G/D slice to each of the I - 1 other islands "
          "(ZeroMQ/CURVE framing and the islands' losses make the rest; '(I-1)/I x G x executors' would count G for "
          "1 + 1, but each island needs the other's whole slice, G/D per executor, so 2G for two islands at any D).")
    worst = [(g["name"], k, c["loss_difference"]) for g in groups for k, c in g["configs"].items()
             if k != g["reference"] and c["loss_difference"] is not None]
    if worst:
        name, key, diff = max(worst, key=lambda t: t[2])
        print(f"losses: every configuration trains the same weights on the same batches; the largest |loss - one "
              f"island| at a common step is {diff:.1e} ({key}, {name}); tolerance {LOSS_TOLERANCE:g}")


def _kind_order(item) -> int:
    return ("grads", "update", "other").index(item[0])


def run_bytes(c: dict) -> float:
    """Bytes per step crossing the link (measured; the theory when there is no relay to count them)."""
    return c["link_bytes_per_step"] if c["link_bytes_per_step"] is not None else c["theory_link_bytes_per_step"]
