"""The evaluation report: report.json (versioned schema), report.md, report.html with PNG plots, CSVs.

Files written into REPORT_DIR (all at once: built in a temp dir beside it, then renamed):
  report.json     machine-readable; ``schema`` / ``schema_version`` name its layout (SCHEMA_VERSION)
  report.md       the verdict and tables, plots linked
  report.html     the same, self-contained (PNG plots embedded as data URIs), opens without a server
  tensors.csv     one row per compared tensor, msit ``debug compare`` column names
  operators.csv   the operator conformance table, same columns
  layer_error.png per-layer relative Euclidean distance and max abs error (log scale) per candidate
  logits_error.png histogram of |candidate - reference| over all logits, per candidate
  dump/           with evaluate.dump: <comparison>/{golden,candidate}/<tensor>.npy, every compared pair
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import shutil
from pathlib import Path

import numpy as np

from titan_pipe.io.atomic import swap_dir, temp_dir
from titan_pipe.errors import UserError
from titan_pipe.evaluate.metrics import CSV_COLUMNS, csv_cells

SCHEMA = "titan-pipe/evaluate-report"
SCHEMA_VERSION = 1
TENSOR_CSV_HEAD = ("Comparison", "Candidate", "Tensor", "Layer", "DType", "Shape")
OPERATOR_CSV_HEAD = ("Operator", "DType", "Case", "Shape", "Status")


def clean_json(x):
    """NaN/Inf as strings ("nan", "inf", "-inf") so report.json is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return clean_json(x.item())
    return x


def headline(report: dict) -> tuple[str, str]:
    """("PASS" or "FAIL", the verdict's text without its own leading "PASS: "/"FAIL: ")."""
    status = "PASS" if report["passed"] else "FAIL"
    text = report["verdict"]["text"]
    for word in ("PASS: ", "FAIL: "):
        if text.startswith(word):
            text = text[len(word) :]
    return status, text


def rounded(x):
    """A detail value for a person: floats to 6 significant digits (report.json keeps them whole)."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return rounded(x.item())
    return x


def _detail(value) -> str:
    return json.dumps(rounded(value))[:600]


def _fmt(v) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.6g}" if v == 0 or 1e-4 <= abs(v) < 1e6 else f"{v:.3e}"
    return str(v)


def plot_layer_errors(comparisons: list[dict], path: Path, thresholds: dict | None = None) -> bool:
    """Two log-scale panels per-layer (relative Euclidean distance, max abs error), one line per
    candidate, the relative-distance threshold of each dtype drawn across the first (a point above
    its line fails). False when no comparison has per-layer rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = []
    for c in comparisons:
        layer_rows = [r for r in c["rows"] if r["layer"] is not None and r["tensor"].startswith("hidden.")]
        if layer_rows:
            series.append((f"{c['id']}: {c['candidate']}", layer_rows))
    if not series:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in series:
        x = [r["layer"] for r in rows]
        for ax, key in zip(axes, ("rel_euclidean", "max_abs")):
            y = [max(r["metrics"][key], 1e-12) if isinstance(r["metrics"][key], float) else np.nan for r in rows]
            ax.plot(x, y, marker="o", label=label)
    dtypes = sorted({c["dtype"] for c in comparisons if c.get("dtype")})
    for dtype in dtypes:
        limit = (thresholds or {}).get(dtype, {}).get("rel_euclidean_max")
        if isinstance(limit, (int, float)) and limit > 0:
            axes[0].axhline(limit, color="red", ls="--", lw=1, label=f"threshold {dtype} ({limit:g})")
    for ax, title in zip(axes, ("relative Euclidean distance", "max absolute error")):
        ax.set_yscale("log")
        ax.set_xlabel("decoder layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title + " (hidden state after layer)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_logits_histogram(errors: dict[str, np.ndarray], path: Path) -> bool:
    """Histogram of |cand - ref| over all logits per candidate, log-spaced bins (zeros at 1e-12)."""
    if not errors:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    finite = [e[np.isfinite(e)] for e in errors.values()]
    top = max([float(e.max()) for e in finite if e.size] + [1e-11])
    bins = np.logspace(-12, math.log10(top) + 0.1, 60)
    for (label, _), e in zip(errors.items(), finite):
        ax.hist(np.clip(e, 1e-12, None), bins=bins, histtype="step", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|candidate - reference| over the logits (exact zeros drawn at 1e-12)")
    ax.set_ylabel("count")
    ax.set_title("logits error histogram")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_csvs(report: dict, out: Path) -> None:
    with open(out / "tensors.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TENSOR_CSV_HEAD + CSV_COLUMNS + ("Status", "Failures"))
        for c in report["comparisons"]:
            for r in c["rows"]:
                w.writerow(
                    [
                        c["id"],
                        r["candidate"],
                        r["tensor"],
                        "" if r["layer"] is None else r["layer"],
                        r["dtype"],
                        "x".join(map(str, r["shape"])),
                    ]
                    + csv_cells(r["metrics"])
                    + [r["status"], " | ".join(r["failures"])]
                )
    with open(out / "operators.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OPERATOR_CSV_HEAD + CSV_COLUMNS + ("Failures",))
        for r in report["operators"]:
            w.writerow(
                [r["op"], r["dtype"], r["case"], "x".join(map(str, r["shape"])), r["status"]]
                + csv_cells(r["metrics"])
                + [" | ".join(r["failures"])]
            )


_SHORT = ("cosine", "rel_euclidean", "max_abs", "mean_rel", "rmse", "kl", "top1")


def _comparison_md(c: dict) -> list[str]:
    lines = [
        f"### {c['id']}: {c['title']}",
        "",
        f"**{c['status']}**"
        + (
            f" — reference `{c['reference']}`, candidate `{c['candidate']}`, thresholds {c['dtype']}"
            if c["reference"]
            else ""
        ),
        "",
    ]
    if c["rows"]:
        lines += ["| tensor | " + " | ".join(_SHORT) + " | status |", "|" + "---|" * (len(_SHORT) + 2)]
        for r in c["rows"]:
            lines.append(
                f"| {r['tensor']} | "
                + " | ".join(_fmt(r["metrics"][k]) for k in _SHORT)
                + f" | {r['status']}{': ' + r['failures'][0] if r['failures'] else ''} |"
            )
        lines.append("")
    for k, v in c["details"].items():
        if k not in ("generated_tokens",):
            lines.append(f"- {k}: `{_detail(v)}`")
    for f in c["failures"][:10]:
        lines.append(f"- failure: {f}")
    return lines + [""]


def operator_matrix(rows: list[dict]) -> tuple[list[str], list[str], dict]:
    """(ops, dtypes, {(op, dtype): summary}) where summary is the worst status over the cases."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    cell: dict = {}
    for r in rows:
        key = (r["op"], r["dtype"])
        prev = cell.get(key)
        rank = {"fail": 2, "pass": 0}.get(r["status"], 1)
        if prev is None or rank > prev[0]:
            cell[key] = (rank, r["status"] if rank != 0 else "pass")
    return ops, dtypes, {k: v[1] for k, v in cell.items()}


def sharded_line(sharded: dict | None) -> str:
    """How the sharded forward's ranks held the model (report.json ``memory.sharded``), or ""."""
    if not sharded:
        return ""
    from titan_pipe.rules.sizes import format_size

    peaks = sharded["peak_rss_per_rank"]
    rss = f", peak RSS {format_size(min(peaks))} to {format_size(max(peaks))} per rank" if peaks else ""
    return f"sharded forward: {sharded['mode']}, {sharded['ranks']} ranks{rss}"


def timing_line(seconds: dict[str, float]) -> str:
    """What each step took, the longest first: "12.3 s before the report: reference generation 5.4 s, ..."."""
    steps = sorted(seconds.items(), key=lambda kv: -kv[1])
    return f"{sum(seconds.values()):.1f} s before the report: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps)


def render_markdown(report: dict, plots: list[str]) -> str:
    status, text = headline(report)
    lines = [
        "# titan-pipe evaluation report",
        "",
        f"**{status}** — {text}",
        "",
        "Inputs: " + ", ".join(f"{k} `{val}`" for k, val in report["inputs"].items() if val),
        "",
    ]
    if report.get("memory"):
        ranks = sharded_line(report["memory"].get("sharded"))
        lines += [
            f"Memory: **{report['memory']['mode']}** ({report['memory']['why']}){'; ' + ranks if ranks else ''}",
            "",
        ]
    if report.get("seconds"):
        lines += [f"Time: {timing_line(report['seconds'])}", ""]
    for p in plots:
        lines.append(f"![{p}]({p})")
    lines += ["", "## Comparisons", ""]
    for c in report["comparisons"]:
        lines += _comparison_md(c)
    if report["operators"]:
        ops, dtypes, cell = operator_matrix(report["operators"])
        lines += [
            "## Operator conformance (worst case over normal/large/tiny/long inputs)",
            "",
            "| operator | " + " | ".join(dtypes) + " |",
            "|" + "---|" * (len(dtypes) + 1),
        ]
        for op in ops:
            lines.append(f"| {op} | " + " | ".join(cell.get((op, d), "") for d in dtypes) + " |")
        lines += [
            "",
            "Every row with its measures: `operators.csv`; every tensor: `tensors.csv` (msit column names).",
            "",
        ]
    lines += _thresholds_md(report.get("thresholds", {}))
    return "\n".join(lines) + "\n"


def _thresholds_md(used: dict) -> list[str]:
    """The threshold sets the verdict used, one column per dtype, with where each comes from."""
    if not used:
        return []
    from titan_pipe.rules.thresholds import SOURCES

    dts = list(used)
    keys = list(dict.fromkeys(k for d in dts for k in used[d]))
    lines = ["## Thresholds used", "", "| key | " + " | ".join(dts) + " | source |", "|" + "---|" * (len(dts) + 2)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_fmt(used[d].get(k, "")) for d in dts) + f" | {SOURCES.get(k, '')} |")
    return lines + [""]


def render_html(report: dict, plot_files: dict[str, Path]) -> str:
    e = html.escape
    status, text = headline(report)
    color = "#1a7f37" if report["passed"] else "#cf222e"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>titan-pipe evaluation</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
        "margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:right}"
        "th{background:#f3f3f3}td.l{text-align:left}.fail{background:#ffebe9}.pass{background:#dafbe1}"
        ".skip{background:#fff8c5}</style></head><body>",
        f"<h1>titan-pipe evaluation report</h1><p style='font-size:18px;color:{color}'><b>"
        f"{status}</b></p><p>{e(text)}</p>",
        "<p>"
        + "<br>".join(f"{e(k)}: <code>{e(str(val))}</code>" for k, val in report["inputs"].items() if val)
        + "</p>",
    ]
    if report.get("memory"):
        ranks = sharded_line(report["memory"].get("sharded"))
        parts.append(
            f"<p>memory: <b>{e(report['memory']['mode'])}</b> ({e(report['memory']['why'])})"
            f"{'; ' + e(ranks) if ranks else ''}</p>"
        )
    if report.get("seconds"):
        parts.append(f"<p>time: {e(timing_line(report['seconds']))}</p>")
    for name, path in plot_files.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<p><img alt='{e(name)}' src='data:image/png;base64,{data}'></p>")
    parts.append("<h2>Comparisons</h2>")
    for c in report["comparisons"]:
        cls = "pass" if c["status"] == "pass" else ("fail" if c["status"] == "fail" else "skip")
        parts.append(
            f"<h3>{e(c['id'])}: {e(c['title'])}</h3><p class='{cls}'>{e(c['status'])}"
            + (
                f" — reference <code>{e(c['reference'])}</code>, candidate <code>{e(c['candidate'])}</code>, "
                f"thresholds {e(c['dtype'])}"
                if c["reference"]
                else ""
            )
            + "</p>"
        )
        if c["rows"]:
            parts.append(
                "<table><tr><th>tensor</th>" + "".join(f"<th>{k}</th>" for k in _SHORT) + "<th>status</th></tr>"
            )
            for r in c["rows"]:
                rc = "fail" if r["failures"] else "pass"
                parts.append(
                    f"<tr class='{rc}'><td class='l'>{e(r['tensor'])}</td>"
                    + "".join(f"<td>{e(_fmt(r['metrics'][k]))}</td>" for k in _SHORT)
                    + f"<td class='l'>{e(r['status'] + (': ' + r['failures'][0] if r['failures'] else ''))}</td></tr>"
                )
            parts.append("</table>")
        items = [f"{k}: {_detail(val)}" for k, val in c["details"].items() if k != "generated_tokens"] + [
            f"failure: {f}" for f in c["failures"][:10]
        ]
        if items:
            parts.append("<ul>" + "".join(f"<li><code>{e(i)}</code></li>" for i in items) + "</ul>")
    if report["operators"]:
        ops, dtypes, cell = operator_matrix(report["operators"])
        parts.append(
            "<h2>Operator conformance</h2><p>worst status over normal / large / tiny / long inputs; "
            "all rows in operators.csv</p><table><tr><th>operator</th>"
            + "".join(f"<th>{e(d)}</th>" for d in dtypes)
            + "</tr>"
        )
        for op in ops:
            cells = []
            for d in dtypes:
                s = cell.get((op, d), "")
                cls = "pass" if s == "pass" else ("fail" if s == "fail" else "skip")
                cells.append(f"<td class='l {cls}'>{e(s)}</td>")
            parts.append(f"<tr><td class='l'>{e(op)}</td>{''.join(cells)}</tr>")
        parts.append("</table>")
    parts += _thresholds_html(report.get("thresholds", {}))
    parts.append("</body></html>")
    return "\n".join(parts)


def _thresholds_html(used: dict) -> list[str]:
    """The threshold sets the verdict used, one column per dtype, with where each comes from."""
    if not used:
        return []
    from titan_pipe.rules.thresholds import SOURCES

    e = html.escape
    dts = list(used)
    keys = list(dict.fromkeys(k for d in dts for k in used[d]))
    parts = [
        "<h2>Thresholds used</h2><table><tr><th>key</th>"
        + "".join(f"<th>{e(d)}</th>" for d in dts)
        + "<th>source</th></tr>"
    ]
    for k in keys:
        parts.append(
            f"<tr><td class='l'>{e(k)}</td>"
            + "".join(f"<td>{e(_fmt(used[d].get(k, '')))}</td>" for d in dts)
            + f"<td class='l'>{e(SOURCES.get(k, ''))}</td></tr>"
        )
    return parts + ["</table>"]


def check_out_dir(out_dir: Path) -> None:
    """REPORT_DIR may be new, empty, or an earlier report (which is replaced); anything else is
    refused, so ``-o runs/<name>`` cannot wipe a run directory."""
    out_dir = Path(out_dir)
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"-o {out_dir}: is a file; give a directory for the report")
    entries = list(out_dir.iterdir())
    if not entries:
        return
    try:
        earlier = json.loads((out_dir / "report.json").read_text()).get("schema") == SCHEMA
    except (OSError, ValueError, AttributeError):
        earlier = False
    ours = {
        "report.json",
        "report.md",
        "report.html",
        "tensors.csv",
        "operators.csv",
        "layer_error.png",
        "logits_error.png",
        "dump",
    }
    if not earlier or any(p.name not in ours for p in entries):
        raise UserError(
            f"-o {out_dir}: exists and is not (only) an earlier titan-pipe report; give a new "
            "directory (e.g. runs/<name>/report) or empty it first"
        )


class TensorDump:
    """evaluate.dump: each compared pair written as it is compared, as
    ``<comparison>/{golden,candidate}/<tensor>.npy`` in its own dtype (bfloat16 as float32), the
    layout msit's / msprobe's compare tools take file by file; staged beside REPORT_DIR and moved
    into the report by write_report (nothing of it stays in memory)."""

    def __init__(self, out_dir: Path):
        self.root = temp_dir(Path(out_dir))
        self.names: list[str] = []

    def put(self, cid: str, tensor: str, golden, candidate) -> None:
        import torch

        for side, t in (("golden", golden), ("candidate", candidate)):
            d = self.root / cid / side
            d.mkdir(parents=True, exist_ok=True)
            if isinstance(t, torch.Tensor):
                t = (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
            np.save(d / f"{tensor}.npy", np.ascontiguousarray(t))
        self.names.append(f"{cid}/{tensor}")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def write_report(
    out_dir: Path, report: dict, logits_errors: dict[str, np.ndarray], dump: TensorDump | None = None
) -> dict[str, Path]:
    """Write every report file into ``out_dir`` atomically (temp dir beside it, then rename).

    An existing ``out_dir`` (empty, or an earlier report: check_out_dir) is replaced only once the
    new report is complete.
    """
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    tmp = temp_dir(out_dir)
    try:
        plots: dict[str, Path] = {}
        if plot_layer_errors(report["comparisons"], tmp / "layer_error.png", report.get("thresholds")):
            plots["layer_error.png"] = tmp / "layer_error.png"
        if plot_logits_histogram(logits_errors, tmp / "logits_error.png"):
            plots["logits_error.png"] = tmp / "logits_error.png"
        dumped = []
        if dump is not None and dump.names:
            shutil.move(str(dump.root), str(tmp / "dump"))
            dumped = dump.names
        report = dict(
            report,
            files=sorted(["report.json", "report.md", "report.html", "tensors.csv", "operators.csv", *plots]),
            dump=dumped,
        )
        write_csvs(report, tmp)
        (tmp / "report.md").write_text(render_markdown(report, list(plots)))
        (tmp / "report.html").write_text(render_html(report, plots))
        (tmp / "report.json").write_text(json.dumps(clean_json(report), indent=1, allow_nan=False))
        swap_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {name: out_dir / name for name in report["files"]}
