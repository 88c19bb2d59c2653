"""Results: per-row summary (ratio, TFLOP/s, SOL, bound, vs the seed), the table in the
seed page's form, per-op geomeans and JSON merge (the picture: plot.py).

JSON: {"gpu", "commit", "date", "clocks", "timer_check", "rows": [{op, workload, dtype,
seed: {ours_ms, ratio, alternatives, tflops, sol_pct, bound}, impls: {name: {"ms":
float|null, "ok": bool, "note": str, ...}}, flops, bytes, ours_ms, best_alt, best_alt_ms,
ratio, ratio_with_seed_columns, tflops, sol_pct, bound, vs_seed}]}.
"""
from __future__ import annotations

import json
import math
import os

from . import roofline
from .workloads import ALL_OPS, TRAIN_OPS

OURS = "linattn"


def comparable(entry: dict, ours: dict | None) -> bool:
    """Whether an alternative's time may be set against linattn's on a row: not where the
    two entries name different GPUs (rows merged from runs on an H100 and an H200)."""
    a, b = (entry or {}).get("gpu"), (ours or {}).get("gpu")
    return not (a and b and a != b)


def summarize(rec: dict, row) -> dict:
    """Fill the derived figures of one row's record in place (and return it)."""
    impls = rec["impls"]
    ms = lambda n: impls.get(n, {}).get("ms") if impls.get(n, {}).get("ok") else None  # noqa: E731
    ours = ms(OURS)
    alts = {n: ms(n) for n in impls if n != OURS and ms(n) is not None
            and comparable(impls[n], impls.get(OURS))}
    flops, nbytes = roofline.counts(row)
    rec.update(flops=flops, bytes=nbytes, ours_ms=ours, best_alt=None, best_alt_ms=None, ratio=None,
               ratio_with_seed_columns=None, tflops=None, sol_pct=None, bound=None, vs_seed=None)
    if alts:
        best = min(alts, key=alts.get)
        rec.update(best_alt=best, best_alt_ms=alts[best])
    seed_alts = dict(row.seed.get("alternatives", {}))
    fallback = {n: t for n, t in seed_alts.items() if n not in alts}
    pool = list(alts.values()) + list(fallback.values())
    timed = ours if ours is not None else rec["best_alt_ms"]
    if timed is not None:
        s = roofline.sol(row, timed)
        rec.update(tflops=s["tflops"], sol_pct=s["sol_pct"], bound=s["bound"], tbps=s["tbps"],
                   figures_of=OURS if ours is not None else rec["best_alt"])
    if ours is not None:
        if alts:
            rec["ratio"] = rec["best_alt_ms"] / ours
        if pool:
            rec["ratio_with_seed_columns"] = min(pool) / ours
        if row.seed.get("ours_ms"):
            rec["vs_seed"] = row.seed["ours_ms"] / ours
    return rec


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def geomeans(records) -> dict:
    """Per op: geomean ratio (vs alternatives timed here), vs_seed, and the row counts."""
    out = {}
    for op in ALL_OPS:
        rs = [r for r in records if r["op"] == op]
        if not rs:
            continue
        gaps = sum(1 for r in rs if r["impls"].get(OURS, {}).get("ms") is None)
        out[op] = {"rows": len(rs), "gaps": gaps,
                   "ratio": geomean([r.get("ratio") for r in rs]),
                   "ratio_with_seed_columns": geomean([r.get("ratio_with_seed_columns") for r in rs]),
                   "vs_seed": geomean([r.get("vs_seed") for r in rs])}
    return out


def family(rec) -> str:
    """GDN workload family (the issue's grouping): decode (one token per sequence),
    varlen (cu_seqlens), GVA tp1..tp8 (the tensor-parallel Qwen3.5 shapes), prefill."""
    import re
    row = table_rows().get((rec["op"], rec["workload"], rec["dtype"]))
    t = rec.get("tensors") or (row.tensors if row is not None else {})
    name = rec["workload"]
    q = (t.get("q") or {}).get("shape")
    if (q and q[1] == 1 and "cu_seqlens" not in t) or "decode" in name:
        return "decode"
    if "cu_seqlens" in t or re.search(r"\d+x\d+|varlen|ragged", name):
        return "varlen"
    m = re.search(r"-tp(\d+)-", name)
    if m:
        return f"GVA tp{m.group(1)}"
    return "prefill"


def table_rows() -> dict:
    """(op, workload, dtype) -> the packaged workload table's row, or the training table's
    (memoised)."""
    global _ROWS
    if _ROWS is None:
        from .workloads import load_rows, train_rows
        _ROWS = {tuple(r.key): r for r in load_rows() + train_rows()}
    return _ROWS


_ROWS = None


def families(records, op="GDNFwd") -> dict:
    """Per family of ``op``'s rows: geomean ratio vs the best alternative timed here, vs
    fla, vs the best of those and the seed table's columns, and vs the seed system."""
    out = {}
    for r in records:
        if r["op"] != op:
            continue
        f = out.setdefault(family(r), {"rows": 0, "timed": 0, "ratio": [], "vs_fla": [],
                                       "ratio_with_seed_columns": [], "vs_seed": []})
        f["rows"] += 1
        ours = (r["impls"].get(OURS) or {})
        fla = (r["impls"].get("fla") or {})
        if ours.get("ok") and ours.get("ms"):
            f["timed"] += 1
            if fla.get("ok") and fla.get("ms"):
                f["vs_fla"].append(fla["ms"] / ours["ms"])
        for k in ("ratio", "ratio_with_seed_columns", "vs_seed"):
            f[k].append(r.get(k))
    return {name: {**{k: v for k, v in f.items() if not isinstance(v, list)},
                   **{k: geomean(v) for k, v in f.items() if isinstance(v, list)}}
            for name, f in sorted(out.items())}


#: the alternatives the summary names one by one ("seed": TileOPs' release, run here)
ALTS = ("fla", "seed", "flashinfer")
DIRECTION = ("Ratios read other / linattn: an alternative's device time over linattn's on the "
             "same row (> 1: linattn is faster), geomean over the rows where both were timed "
             "and correct; 'best' is the fastest alternative timed on each row.")


def _ms(rec, name):
    e = (rec.get("impls") or {}).get(name) or {}
    return e["ms"] if e.get("ok") and e.get("ms") else None


def versus(records) -> dict:
    """Per op: rows, linattn timed, (geomean, rows) of each of ALTS / linattn and of the
    row's best alternative / linattn, and the rows where linattn is behind that best."""
    out = {}
    for op in ALL_OPS:
        rs = [r for r in records if r["op"] == op]
        if not rs:
            continue
        v = {"rows": len(rs), "timed": sum(1 for r in rs if _ms(r, OURS))}
        for alt in ALTS:
            xs = [_ms(r, alt) / _ms(r, OURS) for r in rs if _ms(r, OURS) and _ms(r, alt)
                  and comparable(r["impls"][alt], r["impls"][OURS])]
            v[alt] = (geomean(xs), len(xs))
        best = [r for r in rs if r.get("ratio")]
        v["best"] = (geomean([r["ratio"] for r in best]), len(best))
        v["behind"] = sorted((r["ratio"], r["workload"], r["dtype"], r.get("best_alt"))
                             for r in best if r["ratio"] < 1)
        v["vs_page"] = geomean([r.get("vs_seed") for r in rs])
        out[op] = v
    return out


def provenance(records, generated_matches=None) -> dict:
    """Entries whose run differs from their row's linattn entry, and linattn entries at a
    commit whose generated kernels differ from HEAD's (generated_matches(commit) -> bool or
    None where unknown; default: git diff in the checkout)."""
    check = generated_matches or _generated_matches
    other_run, stale, unknown, commits = 0, 0, 0, {}
    for r in records:
        ours = (r.get("impls") or {}).get(OURS) or {}
        for name, e in (r.get("impls") or {}).items():
            if name != OURS and e and e.get("run") != ours.get("run"):
                other_run += 1
        c = ours.get("commit")
        if c not in commits:
            commits[c] = check(c) if c else None
        stale += commits[c] is False
        unknown += commits[c] is None
    return {"other_run": other_run, "stale": stale, "unknown": unknown,
            "stale_commits": sorted(c for c, ok in commits.items() if ok is False)}


def _generated_matches(commit):
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", "generated"],
                           cwd=os.path.join(here, "..", ".."), capture_output=True, timeout=30)
    except Exception:
        return None
    return {0: True, 1: False}.get(r.returncode)


def summary(records, generated_matches=None) -> str:
    """Markdown: per op the geomeans against fla, TileOPs' release ("seed"), flashinfer and
    the best of them, the rows where linattn is behind, the entries' provenance, the GDN
    families; the TileOPs page's published figures only as a reference column."""
    lines = [DIRECTION, "", "| op | rows | linattn timed | vs fla | vs seed release | vs flashinfer "
             "| vs best | rows behind best | vs TileOPs page (published, reference) |",
             "|---|---|---|---|---|---|---|---|---|"]
    vs = versus(records)
    for op, v in vs.items():
        cells = [_f(v[a][0], "{:.3f}") + (f" ({v[a][1]})" if v[a][1] else "") for a in ALTS + ("best",)]
        lines.append(f"| {op} | {v['rows']} | {v['timed']} | " + " | ".join(cells)
                     + f" | {len(v['behind'])} | {_f(v['vs_page'], '{:.3f}')} |")
    behind = [(op, *b) for op, v in vs.items() for b in v["behind"]]
    lines += ["", f"Rows where linattn is behind the best alternative: {len(behind)}"]
    if behind:
        lines += ["", "| op | workload | dtype | best / linattn | best |", "|---|---|---|---|---|"]
        lines += [f"| {op} | {w} | {d} | {x:.3f} | {b} |" for op, x, w, d, b in behind]
    p = provenance(records, generated_matches)
    lines += ["", f"Provenance: {p['other_run']} entries from another run than their row's linattn "
              f"entry; {p['stale']} linattn entries at a commit whose generated/ differs from "
              f"HEAD's{' (' + ', '.join(p['stale_commits']) + ')' if p['stale_commits'] else ''}; "
              f"{p['unknown']} unknown."]
    lines += ["", "| GDNFwd family | rows | timed | vs fla | vs best alt. | vs TileOPs page |",
              "|---|---|---|---|---|---|"]
    for name, v in families(records).items():
        lines.append(f"| {name} | {v['rows']} | {v['timed']} | {_f(v['vs_fla'], '{:.3f}')} | "
                     f"{_f(v['ratio'], '{:.3f}')} | {_f(v['vs_seed'], '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def _f(x, fmt="{:.4g}"):
    return "-" if x is None else fmt.format(x)


def table(records) -> str:
    """Markdown table in the seed page's form, one section per op."""
    lines = [DIRECTION]
    for op in ALL_OPS:
        rs = [r for r in records if r["op"] == op]
        if not rs:
            continue
        if op in TRAIN_OPS:
            lines += train_section(op, rs)
            continue
        alt_names = sorted({n for r in rs for n in r["impls"] if n != OURS})
        lines += [f"\n### {op}\n",
                  "| Workload | dtype | Ratio | ours ms | " + " | ".join(f"{n} ms" for n in alt_names)
                  + " | TFLOP/s | SOL % | Bound | seed ms | vs seed |",
                  "|" + "---|" * (9 + len(alt_names))]
        for r in rs:
            cells = []
            for n in alt_names:
                i = r["impls"].get(n)
                cells.append("-" if i is None else (_f(i.get("ms")) if i.get("ok") else "FAIL"))
            ours = r["impls"].get(OURS, {})
            ours_cell = _f(ours.get("ms")) if ours.get("ok") else ("gap" if ours.get("ms") is None and
                                                                     "not implemented" in ours.get("note", "")
                                                                     else "FAIL" if ours else "-")
            lines.append(f"| {r['workload']} | {r['dtype']} | {_f(r.get('ratio'), '{:.2f}')} | {ours_cell} | "
                         + " | ".join(cells) + f" | {_f(r.get('tflops'), '{:.3g}')} | "
                         f"{_f(r.get('sol_pct'), '{:.0f}')} | {r.get('bound') or '-'} | "
                         f"{_f(r['seed'].get('ours_ms'))} | {_f(r.get('vs_seed'), '{:.2f}')} |")
    g = geomeans(records)
    lines += ["\n### Geomeans\n", "| op | rows | gaps | ratio | ratio (seed cols) | vs seed |",
              "|---|---|---|---|---|---|"]
    for op, v in g.items():
        lines.append(f"| {op} | {v['rows']} | {v['gaps']} | {_f(v['ratio'], '{:.3f}')} | "
                     f"{_f(v['ratio_with_seed_columns'], '{:.3f}')} | {_f(v['vs_seed'], '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def train_section(op, rs) -> list[str]:
    """Markdown lines of a training op's rows: step times, peak memory, the largest
    relative error over the step's outputs and gradients, per implementation."""
    names = [OURS] + sorted({n for r in rs for n in r["impls"] if n != OURS})
    head = ["Workload", "dtype", "Ratio"] + [f"{n} ms" for n in names] + \
        [f"{n} peak MiB" for n in names] + [f"{n} max err" for n in names]
    lines = [f"\n### {op}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        imp = [r["impls"].get(n) or {} for n in names]
        cells = [_impl_cell(i) for i in imp]
        cells += [_f(i.get("peak_mib"), "{:.0f}") for i in imp]
        cells += [_f(max(i["rel_err"].values()) if i.get("rel_err") else None, "{:.1e}")
                  for i in imp]
        lines.append(f"| {r['workload']} | {r['dtype']} | {_f(r.get('ratio'), '{:.2f}')} | "
                     + " | ".join(cells) + " |")
    return lines


def _impl_cell(i: dict) -> str:
    if not i:
        return "-"
    if i.get("ok"):
        return _f(i.get("ms"))
    return "gap" if "not implemented" in (i.get("note") or "") else "FAIL"


def write_json(doc: dict, path: str):
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    os.replace(tmp, path)


def merge_into(path: str, doc: dict, workloads: list | None = None) -> dict:
    """Merge doc's rows into the file at path (created if missing) by (op, workload, dtype)
    and, within a row, by implementation: an implementation doc measured replaces the
    file's entry of that name, the others stay, and the row's derived figures (ratio,
    TFLOP/s, ...) are computed again from the merged set. Every implementation entry carries
    the commit / date it was measured at (a row's own stamp wins over doc's). Header
    fields (GPU, copy bandwidth, timer check) come from doc where it re-timed every row of
    the file; a partial doc's header is kept under "runs" and the file's stays. workloads: the rows the figures are computed from where they are
    not the packaged tables' (a --workloads-json table)."""
    old = {"rows": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    key = lambda r: (r["op"], r["workload"], r["dtype"])  # noqa: E731
    stamp = {k: doc.get(k) for k in ("commit", "date", "gpu")}

    def stamped(rec, outer):
        rec = {**outer, **rec}
        rec["impls"] = {n: {**{k: rec.get(k) for k in ("commit", "date")}, **e}
                        for n, e in rec.get("impls", {}).items()}
        return rec

    rows = {key(r): stamped(r, {}) for r in old.get("rows", [])}
    table = {**table_rows(), **{tuple(r.key): r for r in workloads or ()}}
    for r in doc["rows"]:
        fresh = stamped(r, stamp)
        prev = rows.get(key(fresh))
        if prev is not None:
            fresh = {**prev, **fresh, "impls": {**prev["impls"], **fresh["impls"]}}
        if key(fresh) in table:
            summarize(fresh, table[key(fresh)])
        rows[key(fresh)] = fresh
    order = {op: i for i, op in enumerate(ALL_OPS)}
    merged_rows = sorted(rows.values(), key=lambda r: order.get(r["op"], len(order)))
    # the header describes the merged table: the implementations of all its rows and their
    # geomeans; what one run alone measured (its budget skips, wall time, compile count)
    # stays in that run's own JSON
    impls = list(dict.fromkeys([*old.get("impls", []), *doc.get("impls", [])]))
    head = {k: v for k, v in doc.items() if k not in RUN_ONLY and k != "runs"}
    whole = {key(r) for r in doc["rows"]} >= {key(r) for r in old.get("rows", [])}
    runs = [*old.get("runs", []), *([] if whole else [head])]
    merged = {**{k: v for k, v in old.items() if k not in RUN_ONLY},
              **(head if whole else {}),
              "impls": impls, "geomeans": geomeans(merged_rows), "rows": merged_rows,
              **({"runs": runs} if runs else {})}
    write_json(merged, path)
    return merged


#: header fields of one run that a merged table does not carry
RUN_ONLY = ("rows", "skipped_for_budget", "wall_s", "precompile")
