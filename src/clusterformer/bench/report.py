"""Markdown tables from benchmark records, so the numbers on the topic pages in docs/ (e.g. docs/speed-and-memory.md)
are pasted, never retyped."""

from __future__ import annotations

import math

__all__ = ["attention_table", "decode_table", "reversible_table"]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def attention_table(records: list[dict], baseline: str = "full") -> str:
    """One row per (mechanism, length): times, peak memory and the speed-ups over ``baseline`` at that length
    (from the same records, i.e. the same run)."""
    failed = [r for r in records if "error" in r]
    records = [r for r in records if "error" not in r]
    base = {r["length"]: r for r in records if r["name"] == baseline}
    lines = [
        "| mechanism | N | fwd ms | fwd+bwd ms | fwd+bwd+aux ms | peak MB | tensor peak MiB | fwd+bwd speed-up vs full "
        "| fwd speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = list(dict.fromkeys(r["name"] for r in records))
    for name in names:
        for r in sorted((r for r in records if r["name"] == name), key=lambda r: r["length"]):
            b = base.get(r["length"])
            speed = f"{b['fwd_bwd_ms'] / r['fwd_bwd_ms']:.1f}x" if b else "-"
            speed_f = f"{b['fwd_ms'] / r['fwd_ms']:.1f}x" if b else "-"
            lines.append(
                f"| {name} | {r['length']} | {_fmt(r['fwd_ms'])} | {_fmt(r['fwd_bwd_ms'])} | "
                f"{_fmt(r.get('fwd_bwd_aux_ms'))} | {_fmt(r['peak_mem_mb'], 0)} | {_fmt(r.get('peak_tensor_mb'), 0)} | "
                f"{speed} | {speed_f} |"
            )
    for r in failed:
        lines.append(f"| {r['name']} | {r['length']} | failed: {r['error']} | | | | | | |")
    if any("graph_error" in r for r in records):
        lines += ["", _graph_table(records, base)]
    return "\n".join(lines)


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.1f}x" if numerator and denominator else "-"


def _graph_table(records: list[dict], base: dict[int, dict]) -> str:
    """The CUDA-graph columns (bench attention --cuda-graph): replayed times, their speed-up over the eager step
    and over the baseline's replayed and eager steps, and the replay-against-eager check."""
    lines = ["| mechanism | N | fwd ms (graph) | fwd+bwd ms (eager) | fwd+bwd ms (graph) | graph / eager | "
             "vs full graph | vs full eager | replay vs eager (output, grads, state) | eager vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in records if "graph_error" in r), key=lambda r: (r["length"], r["name"])):
        if r["graph_error"]:
            lines.append(f"| {r['name']} | {r['length']} | - | {_fmt(r['fwd_bwd_ms'])} | not captured: "
                         f"{' '.join(r['graph_error'].split())[:120]} | | | | | |")
            continue
        b, check = base.get(r["length"], {}), r["graph_check"]
        graph = r["fwd_bwd_graph_ms"]
        lines.append(
            f"| {r['name']} | {r['length']} | {_fmt(r['fwd_graph_ms'])} | {_fmt(r['fwd_bwd_ms'])} | "
            f"{_fmt(graph)} | {_ratio(r['fwd_bwd_ms'], graph)} | "
            f"{_ratio(b.get('fwd_bwd_graph_ms'), graph)} | {_ratio(b.get('fwd_bwd_ms'), graph)} | "
            f"{check['output']:.1e}, {check['grads']:.1e}, {check['state']:.1e} | "
            + (f"{check['eager_output']:.1e}, {check['eager_grads']:.1e}, {check['eager_state']:.1e} |"
               if "eager_output" in check else "- |")
        )
    return "\n".join(lines)


def reversible_table(records: list[dict]) -> str:
    """Peak memory and time per depth, standard vs reversible."""
    depths = sorted({r["depth"] for r in records})
    get = {(r["depth"], r["reversible"]): r for r in records}
    lines = ["| depth | standard peak MB | reversible peak MB | standard fwd+bwd ms | reversible fwd+bwd ms |",
             "|---|---|---|---|---|"]
    for d in depths:
        s, v = get.get((d, False)), get.get((d, True))
        lines.append(
            f"| {d} | {_fmt(s and s['peak_mem_mb'], 0)} | {_fmt(v and v['peak_mem_mb'], 0)} | "
            f"{_fmt(s and s['fwd_bwd_ms'], 0)} | {_fmt(v and v['fwd_bwd_ms'], 0)} |"
        )
    return "\n".join(lines)


def decode_table(records: list[dict], baseline: str = "full") -> str:
    """Cached decoding: time per token, prefill time and cache memory per (mechanism, context), with the speed-up
    per token over ``baseline`` at the same context (same run)."""
    base = {r["context"]: r for r in records if r["name"] == baseline}
    graphs = any("graph_error" in r for r in records)
    lines = ["| mechanism | context | ms / token | speed-up vs full | prefill ms | cache MiB |"
             + (" ms / token (CUDA graph) | graph vs full eager | replay vs eager |" if graphs else ""),
             "|---|---|---|---|---|---|" + ("---|---|---|" if graphs else "")]
    for name in dict.fromkeys(r["name"] for r in records):
        for r in sorted((r for r in records if r["name"] == name), key=lambda r: r["context"]):
            b = base.get(r["context"])
            speed = f"{b['ms_per_token'] / r['ms_per_token']:.1f}x" if b else "-"
            line = (f"| {name} | {r['context']} | {r['ms_per_token']:.3f} | {speed} | "
                    f"{_fmt(r['prefill_ms'], 0)} | {_fmt(r['cache_mb'], 2)} |")
            if graphs and r.get("graph_error"):
                line += f" not captured: {r['graph_error'][:80]} | | |"
            elif graphs:
                graph = r.get("ms_per_token_graph")
                check = r.get("graph_check")
                line += (f" {_fmt(graph, 3)} | {_ratio(b and b['ms_per_token'], graph)} | "
                         f"{'-' if check is None else f'{check:.1e}'} |")
            lines.append(line)
    growth = []
    for name in dict.fromkeys(r["name"] for r in records):
        rows = sorted((r for r in records if r["name"] == name), key=lambda r: r["context"])
        if len(rows) > 1 and rows[0]["context"] < rows[-1]["context"]:
            slope = (math.log(rows[-1]["ms_per_token"] / rows[0]["ms_per_token"])
                     / math.log(rows[-1]["context"] / rows[0]["context"]))
            growth.append(f"{name} N^{slope:.2f}")
    for context in sorted({r["context"] for r in records}):  # the references' verdict per context
        ref = {r["name"]: r for r in records if r["context"] == context and r.get("reference")}
        if {"sdpa-decode", "projections"} <= ref.keys():
            key = "ms_per_token_graph" if graphs and ref["projections"].get("ms_per_token_graph") else "ms_per_token"
            sdpa, floor = ref["sdpa-decode"][key], ref["projections"][key]
            lines += ["", f"At {context} tokens ({'CUDA graphs' if key != 'ms_per_token' else 'eager'}): the "
                          f"sdpa-decode step takes {sdpa:.3f} ms, the step without attention {floor:.3f} ms, so no "
                          f"mechanism's step can be more than {_ratio(sdpa, floor)} faster than sdpa-decode's at "
                          "this shape."]
    if growth:  # time per token ~ N^slope between the shortest and the longest context (sqrt(N): 0.5)
        lines += ["", f"Time per token grows like {', '.join(growth)} from {rows[0]['context']} to "
                      f"{rows[-1]['context']} tokens of context."]
    return "\n".join(lines)
