"""bench_attention's rows and report: one row per configuration, the markdown tables (main,
masked rows against causal ones, peers), the CSV, the plot, and rows read back from CSVs."""

from __future__ import annotations

import csv

from benchmarks import bench_peers
from benchmarks.attention_comm import analytic_comm_bytes
from benchmarks.attention_config import BASELINE, CPU_CORES
from benchmarks.attention_group import is_busy
from benchmarks.attention_masks import CAUSAL
from benchmarks.common import MiB, table_header, table_row, write_csv


def make_row(spec, P, res, base_time, args):
    config, S, threads = spec["config"], spec["S"], spec["threads"]
    analytic = analytic_comm_bytes(config, S, P, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
    if spec.get("mask", CAUSAL) != CAUSAL:  # the formulas are the causal algorithm's; masks skip transfers
        analytic = None
    row = dict(
        config=config,
        S=S,
        P=P,
        threads_per_rank=threads,
        time_s=None,
        speedup=None,
        efficiency=None,
        peak_mib_per_rank="",
        peak_mib_max=None,
        peak_mib_measured_steps_per_rank="",
        comm_mib_analytic=None if analytic is None else analytic / MiB,
        comm_mib_counted=None,
        others_cpu_s=None,
        times="",
        notes="",
        err_out=None,
        err_dq=None,
        err_dk=None,
        err_dv=None,
    )
    if "error" in res:
        row["notes"] = res["error"].replace("|", "/")
        row["comm_mib_analytic"] = None
        return row
    row["time_s"] = res["time"]
    row["times"] = " ".join(f"{t:.4f}" for t in res["times"])
    row["peak_mib_per_rank"] = " / ".join(f"{max(m, 0):.0f}" for m in res["peak_mib"])
    row["peak_mib_max"] = max(res["peak_mib"])
    row["peak_mib_measured_steps_per_rank"] = " / ".join(f"{max(m, 0):.0f}" for m in res["peak_mib_measured"])
    row["comm_mib_counted"] = res["comm_counted"] / MiB
    if row["comm_mib_analytic"] is None and res.get("comm_analytic") is not None:
        row["comm_mib_analytic"] = res["comm_analytic"] / MiB
    for name, value in (res.get("errors") or {}).items():
        row[f"err_{name}"] = value
    notes = [res["check"]] if res["check"] else []
    if not res["peak_reset"]:
        notes.append("high-water mark not reset")
    row["others_cpu_s"] = round(res["others_cpu_s"], 1)
    if is_busy(res):
        notes.append(
            f"BUSY MACHINE: other processes used {res['others_cpu_s']:.0f} CPU-s of "
            f"{CPU_CORES * res['window_s']:.0f}; time inflated"
        )
    row["notes"] = "; ".join(notes)
    if base_time:
        row["speedup"] = base_time / res["time"]
        # speed-up per core, relative to the baseline's cores (the same 2 cores here)
        cores = min(CPU_CORES, P * threads)
        row["efficiency"] = base_time / (res["time"] * cores / CPU_CORES)
    return row


def num(x, fmt):
    return "" if x is None or x == "" else format(x, fmt)


def format_table(rows):
    header = [
        "config",
        "S",
        "P",
        "time (s)",
        "speed-up",
        "efficiency",
        "peak MiB/rank",
        "comm MiB/rank (analytic)",
        "comm MiB/rank (counted)",
        "mask",
        "allowed ratio",
        "notes",
    ]
    lines = [table_header(header)]
    for r in rows:
        lines.append(
            table_row(
                [
                    r["config"],
                    str(r["S"]),
                    str(r["P"]),
                    num(r["time_s"], ".3f"),
                    num(r["speedup"], ".2f"),
                    num(r["efficiency"], ".2f"),
                    r["peak_mib_per_rank"],
                    num(r["comm_mib_analytic"], ".1f"),
                    num(r["comm_mib_counted"], ".1f"),
                    r.get("mask") or CAUSAL,
                    num(r.get("allowed_ratio"), ".3f"),
                    r["notes"],
                ]
            )
        )
    return "\n".join(lines)


def format_mask_summary(rows):
    """Masked rows against the same mode's causal row (same S and P); "" when none was run."""
    causal = {
        (r["config"], r["S"], r["P"]): r["time_s"] for r in rows if (r.get("mask") or CAUSAL) == CAUSAL and r["time_s"]
    }
    masked = [r for r in rows if (r.get("mask") or CAUSAL) != CAUSAL and r["time_s"]]
    if not masked:
        return ""
    header = [
        "mode",
        "mask",
        "S",
        "P",
        "time s",
        "causal time s",
        "time ratio",
        "ideal ratio (allowed/causal)",
        "saving achieved / ideal saving",
    ]
    lines = [table_header(header)]
    for r in masked:
        ideal = r.get("allowed_ratio")
        base = causal.get((r["config"], r["S"], r["P"]))
        if base:
            ratio = r["time_s"] / base
            saving = f"{1 - ratio:.2f} / " + ("—" if ideal is None else f"{1 - ideal:.2f}")
            if ideal is not None and 1 - ideal > 1e-9:
                saving += f" ({(1 - ratio) / (1 - ideal):.0%})"
            cells = [f"{base:.3f}", f"{ratio:.2f}", num(ideal, ".3f") or "—", saving]
        else:
            cells = ["—", "—", num(ideal, ".3f") or "—", "—"]
        lines.append(table_row([r["config"], r["mask"], str(r["S"]), str(r["P"]), f"{r['time_s']:.3f}", *cells]))
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed; no plot written ({path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if r["time_s"] not in (None, ""):
            label = r["config"] if r["config"] == BASELINE else f"{r['config']} (P={r['P']})"
            if (r.get("mask") or CAUSAL) != CAUSAL:
                label += f" {r['mask']}"
            series.setdefault(label, []).append((r["S"], r["time_s"], "BUSY" in (r.get("notes") or "")))
    any_busy = False
    for label, points in series.items():
        points.sort()
        (line,) = ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            linestyle="--" if label == BASELINE else "-",
            label=label,
        )
        busy = [p for p in points if p[2]]
        if busy:  # measured while other processes used the cores: hollow marker
            any_busy = True
            ax.plot(
                [p[0] for p in busy],
                [p[1] for p in busy],
                marker="o",
                linestyle="none",
                markerfacecolor="white",
                markeredgecolor=line.get_color(),
                markersize=9,
            )
    if any_busy:
        ax.text(
            0.99,
            0.01,
            "hollow: measured on a busy machine",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("fwd+bwd time (s), median")
    masks = sorted({r.get("mask") or CAUSAL for r in rows})
    ax.set_title(
        "One attention layer fwd+bwd on CPU (gloo), 2 cores"
        + ("" if masks == [CAUSAL] else f"; masks: {', '.join(masks)}")
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def rows_from_csv(paths):
    """Rows of earlier runs; a row of a later file replaces the same (config, S, P, mask) of an
    earlier one. Files from before masks were measured are causal rows. Speed-up and
    efficiency are recomputed against the (causal) baseline row of each S, for causal rows."""
    merged = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("S", "P", "threads_per_rank"):
                    row[key] = int(row[key])
                row["mask"] = row.get("mask") or CAUSAL  # before allowed_ratio: the CSV's column order
                for key in (
                    "time_s",
                    "speedup",
                    "efficiency",
                    "peak_mib_max",
                    "comm_mib_analytic",
                    "comm_mib_counted",
                    "others_cpu_s",
                    "allowed_ratio",
                    "err_out",
                    "err_dq",
                    "err_dk",
                    "err_dv",
                ):
                    row[key] = float(row[key]) if row.get(key) not in (None, "") else None
                if row["allowed_ratio"] is None and row["mask"] == CAUSAL:
                    row["allowed_ratio"] = 1.0
                merged[(row["config"], row["S"], row["P"], row["mask"])] = row
    rows = list(merged.values())
    base = {r["S"]: r["time_s"] for r in rows if r["config"] == BASELINE and r["mask"] == CAUSAL and r["time_s"]}
    for r in rows:
        if r["time_s"] and r["S"] in base and r["mask"] == CAUSAL:
            cores = min(CPU_CORES, r["P"] * r["threads_per_rank"])
            r["speedup"] = base[r["S"]] / r["time_s"]
            r["efficiency"] = base[r["S"]] / (r["time_s"] * cores / CPU_CORES)
    order = {c: i for i, c in enumerate([BASELINE])}
    masks = list(dict.fromkeys([CAUSAL] + [r["mask"] for r in rows]))
    rows.sort(
        key=lambda r: (
            masks.index(r["mask"]),
            r["S"],
            r["P"] if r["config"] != BASELINE else 0,
            order.get(r["config"], 1),
        )
    )
    return rows


def write_outputs(rows, args, seq_lens):
    print()
    print(format_table(rows))
    peer_table = bench_peers.summary(rows, args.dtype)
    if peer_table:
        print()
        print(
            "peers: errors against SDPA on the whole sequence (max over ranks); ratios of our fastest / "
            "lowest-peak mode at the same S and P over each exact peer's"
        )
        print(peer_table)
    summary = format_mask_summary(rows)
    if summary:
        print()
        print(
            "masked rows against the same mode's causal row (same S, P): saving = 1 - time / causal time, "
            "ideal saving = 1 - allowed ratio"
        )
        print(summary)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"csv written to {args.csv}")
    if args.plot:
        if len(set(seq_lens)) > 1:
            plot(rows, args.plot)
        else:
            print("one sequence length only: no plot (give several --seq-len values)")
