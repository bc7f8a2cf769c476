"""Turning a benchmark's results into docs/benchmarks.md, PNG plots and the measured
curve in docs/buckets.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

END_MARK = "<!-- bench:end (anything below this line is kept when the runner rewrites the file) -->"
CURVE_START = "<!-- bench:buckets:start -->"
CURVE_END = "<!-- bench:buckets:end -->"


def _ms(us: float | None) -> str:
    return "–" if us is None else f"{us / 1000:.2f}"


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**not met**")


def _by_cpu(phase: dict[str, Any]) -> str:
    """The same ratio from the gate's CPU per request (see benchmark._ratio)."""
    if not phase.get("ratio_by_cpu"):
        return ""
    return f"; by gate CPU per request {phase['ratio_by_cpu']:.2f}"


# -- verdicts -------------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target of DESIGN.md: what was measured and whether it holds."""
    phases = results["phases"]
    rows = []
    if "ratio" in phases:
        r = phases["ratio"]
        # The target holds in every round of the run, not on average.
        per_round = [
            x["rejections_per_s"] / x["healthz_per_s"] for x in r["rounds"] if x["healthz_per_s"]
        ]
        worst = min(per_round, default=r["ratio"])
        rows.append(
            {
                "target": f"sold-out rejections/s ≥ {r['target']:g} × /healthz of the same"
                " process, in every round",
                "measured": f"{_n(r['rejections_per_s'])}/s vs {_n(r['healthz_per_s'])}/s"
                f" ({r['connections']} connections; rounds"
                f" {', '.join(f'{x:.2f}' for x in per_round)}){_by_cpu(r)}",
                "value": f"{worst:.2f}× (worst round)",
                "ok": worst >= r["target"],
                "kind": "speed",
            }
        )
    if "limiter" in phases:
        lim = phases["limiter"]
        rows.append(
            {
                "target": "rate-limited rejections/s ≥ 0.9 × sold-out rejections/s of the same"
                " process",
                "measured": f"{_n(lim['limited_per_s'])}/s vs {_n(lim['sold_out_per_s'])}/s"
                f" ({lim['buyers']} buyers, GATE_LIMIT_USER={lim['limit_user']!r},"
                f" {lim['connections']} connections){_by_cpu(lim)}",
                "value": f"{lim['ratio']:.2f}×",
                "ok": lim["ratio"] >= lim["target"],
                "kind": "speed",
            }
        )
    if "buckets" in phases:
        b = phases["buckets"]
        rows.append(
            {
                "target": "committed reservations/s on one hot deal ≥ 3 × the DB-only baseline",
                "measured": f"{_n(b['best_per_s'])}/s ({b['best']['buckets']} buckets,"
                f" {b['best']['connections']} conn.) vs {_n(b['baseline_best_per_s'])}/s"
                f" ({b['baseline_best']['connections']} conn.)",
                "value": f"{b['ratio']:.2f}×",
                "ok": b["ratio"] >= b["target"],
                "kind": "speed",
            }
        )
    if "sellout" in phases:
        g = phases["sellout"]["gate"]
        rows.append(
            {
                "target": f"sell {g['units']:,} units to {g['attempts']:,} buyers: oversold 0",
                "measured": f"{g['units_ordered']:,} units ordered of {g['units']:,}",
                "value": str(g["oversold"]),
                "ok": g["oversold"] == 0 and bool(g["invariant_ok"]),
                "kind": "correctness",
            }
        )
        rows.append(
            {
                "target": "… lost 0 (no invariant gap, no unit left while buyers were told"
                " SOLD_OUT)",
                "measured": f"invariant gap {g['lost']}, ghost {g.get('ghost', 0)},"
                f" unsold {g['unsold']} ({g['client_other']} buyers shed), Redis {g['redis']}",
                "value": str((g["lost"] or 0) + (g.get("ghost") or 0)),
                "ok": g["lost"] == 0 and not g.get("ghost") and bool(g["invariant_ok"]),
                "kind": "correctness",
            }
        )
        rows.append(
            {
                "target": "… DB reservation attempts ≤ 1.05 × units",
                "measured": f"{g.get('db_attempts', g['db_calls']):,} reservations sent to the"
                f" database for {g['units']:,} units, in {g['db_calls']:,} procedure calls",
                "value": f"{g.get('db_attempts_per_unit', g['db_calls_per_unit']):.3f}×",
                "ok": g.get("db_attempts_per_unit", g["db_calls_per_unit"])
                <= phases["sellout"]["target_calls_per_unit"],
                "kind": "speed",
            }
        )
        rows.append(
            {
                "target": "… time to sell out (no target; the baseline for comparison)",
                "measured": f"gate {g['time_to_sell_out_s']} s"
                + (
                    f", baseline {phases['sellout']['baseline']['time_to_sell_out_s']} s"
                    if "baseline" in phases["sellout"]
                    else ""
                ),
                "value": f"{g['time_to_sell_out_s']} s",
                "ok": None,
                "kind": "info",
            }
        )
    if "latency" in phases:
        for run in phases["latency"]["gate"]:
            rows.append(
                {
                    "target": f"p50 / p99 at {run['share']:.0%} of peak (no target)",
                    "measured": f"{_n(run['committed_per_s'])}/s"
                    f" ({run['achieved_share']:.0%} of peak achieved)",
                    "value": f"{_ms(run['latency_us']['p50'])} /"
                    f" {_ms(run['latency_us']['p99'])} ms",
                    "ok": None,
                    "kind": "info",
                }
            )
    for row in phases.get("peer", {}).get("rows", []):
        g, lean = row["gate"], row["lean"]
        rows.append(
            {
                "target": f"committed reservations/s, {row['buckets']}-bucket deal,"
                f" {row['workers']} worker(s) each, {row['connections']} connections"
                f" ≥ {row['target']:g} × the lean DB-only peer",
                "measured": f"{_n(g['committed_per_s'])}/s vs {_n(lean['committed_per_s'])}/s"
                f" (gate CPU {_n(g['cpu_us_per_commit'])} µs per commit)",
                "value": f"{row['ratio']:.2f}×",
                "ok": row["ratio"] >= row["target"],
                "kind": "speed",
            }
        )
    if "expiry" in phases:
        e = phases["expiry"]
        rows.append(
            {
                "target": f"expiry inside gate serve: {e['holds']:,} API-made holds released"
                f" until the deal view shows every unit ≥ {e['target']:,}/s",
                "measured": f"{e['elapsed_s']} s (gate CPU {_n(e['cpu_us_per_hold'])} µs per hold,"
                f" {e.get('view_polls', '?')} deal-view polls included)",
                "value": f"{_n(e['holds_per_s'])}/s",
                "ok": bool(e["released_all"]) and e["holds_per_s"] >= e["target"],
                "kind": "speed",
            }
        )
        rows.append(
            {
                "target": "… every invariant after the releases",
                "measured": "; ".join(e["breaches"]) or "invariant, Redis = DB",
                "value": "holds" if e["invariant_ok"] else "BREACH",
                "ok": e["invariant_ok"],
                "kind": "correctness",
            }
        )
    return rows


def all_met(results: dict[str, Any]) -> bool:
    return all(r["ok"] is not False for r in verdicts(results))


def correctness_ok(results: dict[str, Any]) -> bool:
    return all(r["ok"] is not False for r in verdicts(results) if r["kind"] == "correctness")


def summary(results: dict[str, Any]) -> str:
    lines = ["", "target | measured | value | verdict"]
    for row in verdicts(results):
        lines.append(
            f"{row['target']} | {row['measured']} | {row['value']} | {_verdict(row['ok'])}"
        )
    return "\n".join(lines).replace("**", "")


# -- plots ----------------------------------------------------------------------------------


def plots(results: dict[str, Any], img_dir: Path) -> dict[str, Path]:
    """PNG plots of the buckets phase; none (and no error) without matplotlib."""
    b = results["phases"].get("buckets")
    if not b:
        return {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    img_dir.mkdir(parents=True, exist_ok=True)
    runs = list(b["gate"].values())
    conns = sorted({r["connections"] for r in runs})
    counts = sorted({r["buckets"] for r in runs})
    base = b["baseline"]
    out: dict[str, Path] = {}

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in conns:
        series = sorted((r["buckets"], r) for r in runs if r["connections"] == c)
        xs = [n for n, _ in series]
        (line,) = ax1.plot(
            xs, [r["committed_per_s"] for _, r in series], "o-", label=f"gate, {c} conn."
        )
        ax2.plot(
            xs, [r["latency_us"]["p99"] / 1000 for _, r in series], "o-", color=line.get_color()
        )
        if str(c) in base:
            ax1.axhline(
                base[str(c)]["committed_per_s"],
                ls="--",
                color=line.get_color(),
                lw=1,
                label=f"baseline, {c} conn.",
            )
            ax2.axhline(
                base[str(c)]["latency_us"]["p99"] / 1000, ls="--", color=line.get_color(), lw=1
            )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("buckets")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("committed reservations/s")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("p99 latency (ms)")
    ax2.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.set_title("Throughput against bucket count (dashed: baseline)")
    ax2.set_title("p99 against bucket count (dashed: baseline)")
    fig.tight_layout()
    out["buckets"] = img_dir / "bench-buckets.png"
    fig.savefig(out["buckets"], dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in counts:
        series = sorted((r["connections"], r) for r in runs if r["buckets"] == n)
        xs = [c for c, _ in series]
        ax1.plot(xs, [r["committed_per_s"] for _, r in series], "o-", label=f"gate, {n} bucket(s)")
        ax2.plot(xs, [r["latency_us"]["p99"] / 1000 for _, r in series], "o-")
    bx = sorted(int(c) for c in base)
    ax1.plot(bx, [base[str(c)]["committed_per_s"] for c in bx], "s--k", label="baseline (DB only)")
    ax2.plot(bx, [base[str(c)]["latency_us"]["p99"] / 1000 for c in bx], "s--k")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conns, [str(c) for c in conns])
        ax.set_xlabel("concurrent connections")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("committed reservations/s")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("p99 latency (ms)")
    ax2.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.set_title("Throughput against concurrency")
    ax2.set_title("p99 against concurrency")
    fig.tight_layout()
    out["concurrency"] = img_dir / "bench-concurrency.png"
    fig.savefig(out["concurrency"], dpi=110)
    plt.close(fig)
    return out


# -- markdown -------------------------------------------------------------------------------


def curve_table(results: dict[str, Any]) -> list[str]:
    b = results["phases"]["buckets"]
    runs = list(b["gate"].values())
    conns = sorted({r["connections"] for r in runs})
    counts = sorted({r["buckets"] for r in runs})
    head = "| buckets | " + " | ".join(f"{c} conn.: commits/s (p99 ms)" for c in conns) + " |"
    lines = [head, "|---:|" + "---:|" * len(conns)]
    for n in counts:
        cells = []
        for c in conns:
            r = b["gate"].get(f"{n}/{c}")
            cells.append(
                "–" if r is None else f"{_n(r['committed_per_s'])} ({_ms(r['latency_us']['p99'])})"
            )
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    cells = []
    for c in conns:
        r = b["baseline"].get(str(c))
        cells.append(
            "–" if r is None else f"{_n(r['committed_per_s'])} ({_ms(r['latency_us']['p99'])})"
        )
    lines.append("| baseline (DB only, 1 row) | " + " | ".join(cells) + " |")
    return lines


def _cpu(cpu: dict[str, float] | None) -> str:
    if not cpu:
        return "–"
    return ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if k != "machine")


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base)


ROOT = Path(__file__).resolve().parent.parent


def _template(command: str) -> str:
    """A wrk command as one would type it from the repository: run-specific paths
    (the token file, the done-marker directory) shown as placeholders."""
    parts = []
    for part in command.split(" "):
        if part.endswith(".txt"):
            part = "<tokens>"
        elif "bench-once-" in part:
            part = "<done-dir>"
        parts.append(part.replace(str(ROOT) + "/", ""))
    return " ".join(parts)


def write_markdown(
    results: dict[str, Any], out: Path, plot_files: dict[str, Path], relative_to: Path
) -> None:
    env = results.get("environment", {})
    plan = results["plan"]
    phases = results["phases"]
    cmds = results.get("commands", {})
    lines = [
        "# Benchmarks",
        "",
        "Generated by `loadtest/bench` (see `loadtest/README.md`); rerun it to refresh. The gate",
        "and the DB-only peer baseline (article 000's statements, no Redis, one stock row; see",
        "`loadtest/baseline/`) run side by side on the same machine, started by the runner, and",
        "every ratio below compares two measurements of the same run.",
        "",
    ]
    if plan.get("quick"):
        lines += ["> **Quick smoke run**: short measurements, not representative.", ""]
    lines += ["## Targets", "", "| target | measured | value | verdict |", "|---|---|---:|---|"]
    for row in verdicts(results):
        lines.append(
            f"| {row['target']} | {row['measured']} | {row['value']} | {_verdict(row['ok'])} |"
        )
    lines += [
        "",
        "## Machine and build",
        "",
        f"- date: {env.get('date_utc', '?')}; run took {results.get('elapsed_s', '?')} s",
        f"- commit: `{env.get('commit', '?')}`"
        + (" (with uncommitted changes)" if env.get("dirty") else ""),
        f"- CPU: {env.get('cpu', '?')}, {env.get('cpus', '?')} logical CPUs;"
        f" memory {env.get('memory', '?')};"
        f" kernel {env.get('kernel', '?')}",
        f"- Python {env.get('python', '?')}, MariaDB {env.get('mariadb', '?')}"
        f" (buffer pool {env.get('buffer_pool_mib', '?')} MiB during the run),"
        f" Redis {env.get('redis', '?')}, {env.get('wrk', 'wrk ?')}",
        f"- load average (1 min) before / after: {env.get('load_before', 0):.2f} /"
        f" {env.get('load_after', 0):.2f} (anything else running skews every number)",
        f"- gate and baseline each with {plan['workers']} worker process(es); wrk with"
        f" {plan['threads']} thread(s) on the same machine",
        "",
        "## Commands",
        "",
        "```sh",
        cmds.get("bench", "loadtest/bench"),
        "# started by the runner:",
        cmds.get("gate", ""),
        cmds.get("baseline", ""),
        "```",
        "",
    ]
    examples = []
    if "ratio" in phases and phases["ratio"]["rounds"]:
        rnd = phases["ratio"]["rounds"][0]
        examples += [rnd["healthz"]["command"], rnd["sold_out"]["command"]]
    if "limiter" in phases and phases["limiter"]["rounds"]:
        examples.append(phases["limiter"]["rounds"][0]["limited"]["command"])
    if "buckets" in phases:
        first = next(iter(phases["buckets"]["gate"].values()))
        examples.append(first["command"])
    if "sellout" in phases:
        examples.append(phases["sellout"]["gate"]["wrk"]["command"])
    if examples:
        lines += [
            "Load generator (wrk; `<tokens>` is a file of `user_id token` lines the runner mints,",
            "the script arguments are described in `loadtest/wrk/reserve.lua`):",
            "",
            "```sh",
            *(_template(c) for c in examples),
            "```",
            "",
        ]

    if "ratio" in phases:
        r = phases["ratio"]
        lines += [
            "## Sold-out rejections against /healthz",
            "",
            f"One deal with one unit, sold before the measurement; then /healthz (no I/O) and"
            f" reservations on the sold-out deal alternate for {plan['duration_s']:g} s each at"
            f" {r['connections']} connections. Buyers: a pool of {plan['buyers']:,} who click"
            " again and again (after the warm-up every worker has verified and cached their"
            " tokens), a fresh Idempotency-Key on every click.",
            "",
            "| round | /healthz per s | sold-out rejections per s | 409 share | ratio"
            " | gate CPU µs/request healthz / sold-out | CPU (cores) healthz / sold-out |",
            "|---:|---:|---:|---:|---:|---|---|",
        ]
        for i, rnd in enumerate(r["rounds"], 1):
            ratio = rnd["rejections_per_s"] / rnd["healthz_per_s"] if rnd["healthz_per_s"] else 0
            lines.append(
                f"| {i} | {_n(rnd['healthz_per_s'])} | {_n(rnd['rejections_per_s'])} |"
                f" {rnd['rejected_share']:.1%} | {ratio:.2f} |"
                f" {_n(rnd['healthz'].get('cpu_us_per_request'), 1)} /"
                f" {_n(rnd['sold_out'].get('cpu_us_per_request'), 1)} |"
                f" {_cpu(rnd['healthz'].get('cpu_cores'))} /"
                f" {_cpu(rnd['sold_out'].get('cpu_cores'))} |"
            )
        lines.append("")

    if "limiter" in phases:
        lim = phases["limiter"]
        lines += [
            "## Rate-limited rejections against sold-out rejections",
            "",
            f"A second gate process, started for this phase with"
            f" `GATE_LIMIT_USER={lim['limit_user']}` (command above), and"
            f" {lim['buyers']} buyers clicking again and again at {lim['connections']}"
            " connections with a fresh Idempotency-Key each time: on a deal with one unit,"
            " sold before the measurement (409), and on a deal with plenty of stock where"
            " each buyer's first click, during the warm-up, spent their limit (429)."
            f" {plan['duration_s']:g} s each, alternating. CPU per request is the gate"
            " processes' user + system time over the run divided by the answers.",
            "",
            "| round | sold-out per s | rate-limited per s | ratio"
            " | gate CPU µs/request sold-out / limited | CPU (cores) sold-out / limited |",
            "|---:|---:|---:|---:|---|---|",
        ]
        for i, rnd in enumerate(lim["rounds"], 1):
            so, li = rnd["sold_out"], rnd["limited"]
            ratio = li["rejections_per_s"] / so["rejections_per_s"] if so["rejections_per_s"] else 0
            lines.append(
                f"| {i} | {_n(so['rejections_per_s'])} | {_n(li['rejections_per_s'])} |"
                f" {ratio:.2f} | {_n(so.get('cpu_us_per_request'), 1)} /"
                f" {_n(li.get('cpu_us_per_request'), 1)} |"
                f" {_cpu(so.get('cpu_cores'))} / {_cpu(li.get('cpu_cores'))} |"
            )
        lines.append("")

    if "buckets" in phases:
        b = phases["buckets"]
        lines += [
            "## Committed reservations on one hot deal",
            "",
            f"A fresh deal with {50_000_000:,} units per cell (it never sells out), one unit per"
            f" order, {plan['buyers']:,} buyers cycling, a fresh key per request; warm-up"
            f" {plan['warmup_s']:g} s, then {plan['duration_s']:g} s measured. Committed/s counts"
            " the deal's order rows in the database before and after the measured run.",
            "",
            *curve_table(results),
            "",
            f"Best: **{_n(b['best_per_s'])}/s** with {b['best']['buckets']} buckets at"
            f" {b['best']['connections']} connections;"
            f" baseline best {_n(b['baseline_best_per_s'])}/s"
            f" → **{b['ratio']:.2f}×** (target 3×).",
            "",
        ]
        best = b["gate"][f"{b['best']['buckets']}/{b['best']['connections']}"]
        base = b["baseline"][str(b["baseline_best"]["connections"])]
        lines += [
            f"CPU in cores during the best runs — gate: {_cpu(best.get('cpu_cores'))};"
            f" baseline: {_cpu(base.get('cpu_cores'))}.",
            "",
        ]
        for key, caption in (
            ("buckets", "Throughput and p99 against bucket count"),
            ("concurrency", "Throughput and p99 against concurrency"),
        ):
            if key in plot_files:
                lines += [f"![{caption}]({_rel(plot_files[key], relative_to)})", ""]
        if not plot_files:
            lines += ["(No plots: matplotlib is not installed.)", ""]

    if "sellout" in phases:
        s = phases["sellout"]
        lines += [
            "## Selling out",
            "",
            "Every buyer makes exactly one attempt with its own token and key, as fast as"
            " the connections allow. Time to sell out is the database's time from the start"
            " to the last order's `created_at`. DB reservation attempts are the reservations"
            " the gate sent to the database (its `gate_reservation_db_attempts_total`: each"
            " reservation of a group and every retry counts); procedure calls are the"
            " server's `Com_call_procedure` delta (every client of the server counts, so on"
            " a busy server it is an upper bound). For the baseline every attempt is a"
            " transaction.",
            "",
            "| | gate | baseline |",
            "|---|---:|---:|",
        ]
        g = s["gate"]
        bl = s.get("baseline", {})
        for label, key in (
            ("buckets", "buckets"),
            ("units / buyers", None),
            ("connections", "connections"),
            ("time to sell out (s)", "time_to_sell_out_s"),
            ("all buyers answered (s)", "all_answered_s"),
            ("orders", "orders"),
            ("answers 201 / 409 / other", None),
            ("oversold", "oversold"),
            ("lost (invariant gap)", "lost"),
            ("ghost (left while buyers were told SOLD_OUT)", "ghost"),
            ("unsold", "unsold"),
            ("DB reservation attempts", "db_attempts"),
            ("… per unit", "db_attempts_per_unit"),
            ("procedure calls (round trips)", "db_calls"),
            ("… less other clients' calls (estimate)", "db_calls_less_noise"),
            ("invariant and Redis = DB", None),
            ("CPU (cores)", None),
        ):
            if key is not None:
                lines.append(f"| {label} | {g.get(key, '–')} | {bl.get(key, '–')} |")
            elif label.startswith("units"):
                lines.append(
                    f"| {label} | {g['units']:,} / {g['attempts']:,} |"
                    f" {bl.get('units', 0):,} / {bl.get('attempts', 0):,} |"
                )
            elif label.startswith("answers"):
                lines.append(
                    f"| {label} | {g['client_201']} / {g['client_409']} / {g['client_other']} |"
                    f" {bl.get('client_201', '–')} / {bl.get('client_409', '–')} /"
                    f" {bl.get('client_other', '–')} |"
                )
            elif label.startswith("invariant"):
                lines.append(
                    f"| {label} | {'holds' if g['invariant_ok'] else 'BREACH'},"
                    f" Redis {g['redis']} |"
                    f" {('holds' if bl.get('invariant_ok') else 'BREACH') if bl else '–'} |"
                )
            else:
                lines.append(
                    f"| {label} | {_cpu(g.get('cpu_cores'))} | {_cpu(bl.get('cpu_cores'))} |"
                )
        for breach in g.get("breaches", []):
            lines.append(f"\n- gate breach: {breach}")
        lines.append("")

    if "latency" in phases:
        lat = phases["latency"]
        lines += [
            "## Latency at 50 % and 90 % of peak",
            "",
            "The peak is the best committed/s above (same buckets). Each connection pauses"
            " between requests (exponentially distributed, the mean found by bisection over"
            " up to six short calibration runs, until the rate is within 5 % of the aim) so"
            " the offered rate is the share of the peak. Paused connections offer less than"
            " the peak's closed loop, so where the peak's connections fall short even with"
            " short pauses the run doubles them (up to 1,024) and searches again. wrk"
            " measures from sending a request to its answer. A closed loop like this hides"
            " queueing when the server stalls (coordinated omission), so p99 is a lower bound.",
            "",
            "| server | target share | achieved | commits/s | connections | mean pause ms"
            " | p50 ms | p90 ms | p99 ms | CPU (cores) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name in ("gate", "baseline"):
            for run in lat.get(name, []):
                lines.append(
                    f"| {name} | {run['share']:.0%} | {run['achieved_share']:.0%} |"
                    f" {_n(run['committed_per_s'])} | {_n(run['connections'])} |"
                    f" {run['delay_ms']:.1f} | {_ms(run['latency_us']['p50'])} |"
                    f" {_ms(run['latency_us']['p90'])} | {_ms(run['latency_us']['p99'])} |"
                    f" {_cpu(run.get('cpu_cores'))} |"
                )
        lines.append("")

    lines += [
        "## Method notes",
        "",
        "- Both servers: Starlette on uvicorn with uvloop and httptools, orjson, the gate's",
        "  aiomysql pool and session settings (READ COMMITTED, UTC, short lock wait), the gate's",
        "  JWT verification with its token cache. Rate limits are off (`GATE_LIMIT_*=off`)",
        "  except in the limiter phase's own gate.",
        "- The load generator shares the machine's cores with the servers, MariaDB and Redis;",
        "  every ratio compares runs that paid the same client cost.",
        "- Raw results (every wrk run, CPU per component) are in the run's `results.json`.",
        "",
        END_MARK,
        "",
    ]
    text = "\n".join(lines)
    if out.exists():
        old = out.read_text()
        if END_MARK in old:
            kept = old.split(END_MARK, 1)[1].lstrip("\n")
            text = text + kept
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def update_buckets_guide(guide: Path, results: dict[str, Any], plot_files: dict[str, Path]) -> bool:
    """Replace the measured curve between the markers of docs/buckets.md."""
    if not guide.exists():
        return False
    text = guide.read_text()
    if CURVE_START not in text or CURVE_END not in text:
        return False
    env = results.get("environment", {})
    b = results["phases"]["buckets"]
    body = [
        CURVE_START,
        "",
        f"Measured by `loadtest/bench` on {env.get('date_utc', '?')} (commit"
        f" `{env.get('commit', '?')}`, {env.get('cpus', '?')} CPUs,"
        f" {results['plan']['workers']} gate workers); committed reservations/s with p99 in"
        " ms, one hot deal:",
        "",
        *curve_table(results),
        "",
        f"Best here: {b['best']['buckets']} buckets ({_n(b['best_per_s'])}/s,"
        f" {b['ratio']:.2f}× the DB-only baseline). Full report: [benchmarks.md](benchmarks.md).",
        "",
    ]
    if "buckets" in plot_files:
        body += [
            "![Throughput and p99 against bucket count]"
            f"({_rel(plot_files['buckets'], guide.parent)})",
            "",
        ]
    body.append(CURVE_END)
    head, rest = text.split(CURVE_START, 1)
    _, tail = rest.split(CURVE_END, 1)
    guide.write_text(head + "\n".join(body) + tail)
    return True
