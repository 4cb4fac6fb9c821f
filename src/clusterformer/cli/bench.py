"""``clusterformer bench {attention,decode,retrieval,prefill,reversible,report}``: time and memory benchmarks
(docs/speed-and-memory.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .._io import emit_json, read_json
from ..bench.attention import COMPILE_MODES
from ._args import int_list, json_object, log, mechanism, name_list


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    p = bench_sub.add_parser("attention", help="time and memory of attention layers against length")
    p.add_argument("--names", type=name_list, default=name_list("full,neural-clustering"),
                   help="comma-separated mechanism names, or 'all'")
    p.add_argument("--lengths", type=int_list, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16", "fp32", "fp64", "bf16", "fp16"],
                   help="bf16/fp16/fp32/fp64 are aliases")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--causal", action="store_true",
                   help="call the layers with causal=True (strict causal mechanisms use their causal chunking)")
    p.add_argument("--padding", type=float, default=0.0,
                   help="right padding, a fraction of N in [0, 1): sequence b of the batch is padded by "
                        "padding * N * b / (batch - 1) tokens (the only sequence, with --batch 1); 0 = no mask")
    p.add_argument("--options", default=None,
                   help='per-mechanism options as JSON, e.g. {"neural-clustering": {"look_back": 2}}')
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: also time the eval forward and the training step replayed from CUDA graphs, "
                        "checked against the eager steps (fwd_graph_ms, fwd_bwd_graph_ms, graph_check)")
    p.add_argument("--compile", default=None, choices=list(COMPILE_MODES),
                   help="torch.compile each layer in this mode first ('eager': Dynamo's tracing alone, any machine); "
                        "first_step_s records the first step, compilation included")
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.add_argument("--plot", default=None, help="write a log-log time/memory plot here (PNG)")
    p.set_defaults(func=run_attention)

    p = bench_sub.add_parser("decode", help="time per generated token with the attention cache against context")
    p.add_argument("--names", type=name_list, default=name_list("full,neural-clustering"),
                   help="comma-separated strictly causal mechanisms")
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="consecutive decoding steps per timed run")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--options", default=None, help="per-mechanism options as JSON")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: also time the step replayed from a CUDA graph, checked against eager steps "
                        "(ms_per_token_graph, graph_check)")
    p.add_argument("--references", action="store_true",
                   help="also time, per context, the step as a flash-decoding kernel runs it (sdpa-decode: one "
                        "unmasked SDPA call over the context's keys) and the step without attention (projections: "
                        "the floor under every mechanism's step at this shape)")
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.set_defaults(func=run_decode)

    p = bench_sub.add_parser("retrieval", help="decode attention time per token over a long cache: dense SDPA vs "
                                               "cluster retrieval (SmolLM2 shapes)")
    p.add_argument("--contexts", type=int_list, default=[2048, 4096, 8192, 16384])
    p.add_argument("--methods", default="dense,sink-window,cluster-retrieval",
                   help="dense and cache readers NAME[:key=value,...] (sink-window, cluster-retrieval, oracle, quest), "
                        "separated by ';' (or ',' without options), e.g. "
                        "'dense;cluster-retrieval;cluster-retrieval:kernel=torch'")
    p.add_argument("--budget", type=float, default=0.1, help="fraction (<= 1) or count (> 1) of keys per query")
    p.add_argument("--options", default=None, help='options of every cluster-retrieval entry as JSON, e.g. '
                                                   '{"num_clusters": 128}')
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=64, help="timed decoding steps after the one that builds the index")
    p.add_argument("--answer-tokens", type=int, default=48,
                   help="also report the time per token of an answer this long, the index build spread over it "
                        "alone (longctx's answers are at most 48 tokens)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.set_defaults(func=run_retrieval)

    p = bench_sub.add_parser("prefill", help="whole-model prefill time of a pretrained decoder: dense vs sparse "
                                             "prefills (prefill_block), and the model without attention")
    p.add_argument("--lengths", type=int_list, default=[4096, 8192])
    p.add_argument("--methods", default="cluster-retrieval:prefill_block=256;sink-window:prefill_block=256",
                   help="';'-separated cache readers NAME[:key=value,...] (dense and the no-attention floor are "
                        "always timed)")
    p.add_argument("--budget", type=float, default=0.1, help="fraction (<= 1) or count (> 1) of keys per query")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round; medians")
    p.add_argument("--no-floor", action="store_true", help="skip the model with attention replaced by zeros")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.set_defaults(func=run_prefill)

    p = bench_sub.add_parser("reversible", help="peak memory of an encoder against depth, reversible or not")
    p.add_argument("--depths", type=int_list, default=[1, 2, 4, 8])
    p.add_argument("--attention", type=mechanism, default="neural-clustering")
    p.add_argument("--options", default=None, help="options of that mechanism as JSON")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tied", action="store_true", help="reversible blocks with the tied connection H")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.set_defaults(func=run_reversible)

    p = bench_sub.add_parser("report", help="markdown table of a benchmark JSON file")
    p.add_argument("--json", required=True, help="records written by bench attention or bench reversible")
    p.add_argument("--plot", default=None, help="also (re)draw the time/memory plot of attention records (PNG)")
    p.set_defaults(func=run_report)


def run_attention(args: argparse.Namespace) -> int:
    from ..bench import BenchConfig, run_attention_benchmark
    from ..bench.attention import DTYPE_ALIASES

    options = json_object("--options", args.options, '{"neural-clustering": {"look_back": 2}}')
    if not all(isinstance(v, dict) for v in options.values()):
        raise ValueError('--options must be a JSON object {"name": {"option": value}}')
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but CUDA is not available")
    config = BenchConfig(
        names=args.names, lengths=args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        device=args.device, dtype=DTYPE_ALIASES.get(args.dtype, args.dtype), warmup=args.warmup,
        repeats=args.repeats, threads=args.threads, options=options, padding=args.padding,
        causal=args.causal, cuda_graph=args.cuda_graph, compile=args.compile,
    )
    records = run_attention_benchmark(config, progress=log)
    _emit(records, args)
    if args.plot:
        from ..bench.plot import plot_attention_benchmark

        log(f"wrote {plot_attention_benchmark(records, args.plot)}")
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from ..bench.decode import DecodeBenchConfig, run_decode_benchmark
    from ..bench.report import decode_table

    options = json_object("--options", args.options, '{"neural-clustering": {"causal_chunk_size": 32}}')
    config = DecodeBenchConfig(names=args.names, contexts=args.contexts, batch=args.batch, heads=args.heads,
                               head_dim=args.head_dim, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                               device=args.device, dtype=args.dtype, threads=args.threads, options=options,
                               cuda_graph=args.cuda_graph, references=args.references)
    return _emit(run_decode_benchmark(config, progress=log), args, decode_table)


def run_retrieval(args: argparse.Namespace) -> int:
    from ..bench.retrieval import RetrievalBenchConfig, retrieval_table, run_retrieval_benchmark

    options = json_object("--options", args.options, '{"num_clusters": 128}')
    config = RetrievalBenchConfig(contexts=args.contexts, methods=_methods(args), budget=_budget(args), options=options,
                                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, steps=args.steps,
                                  answer_tokens=args.answer_tokens, threads=args.threads)
    return _emit(run_retrieval_benchmark(config, progress=log), args, retrieval_table)


def run_prefill(args: argparse.Namespace) -> int:
    from ..bench.prefill import PrefillBenchConfig, prefill_table, run_prefill_benchmark

    config = PrefillBenchConfig(lengths=args.lengths, methods=_methods(args), budget=_budget(args), model=args.model,
                                repeats=args.repeats, floor=not args.no_floor, data_dir=args.data_dir,
                                threads=args.threads)
    return _emit(run_prefill_benchmark(config, progress=log), args, prefill_table)


def run_reversible(args: argparse.Namespace) -> int:
    from ..bench.reversible import ReversibleBenchConfig, run_reversible_benchmark

    options = json_object("--options", args.options, '{"num_clusters": 16}')
    if any(d < 1 for d in args.depths):
        raise ValueError(f"--depths must be positive, got {args.depths}")
    config = ReversibleBenchConfig(depths=args.depths, attention=args.attention, options=options, length=args.length,
                                   batch=args.batch, dim=args.dim, heads=args.heads, tied=args.tied,
                                   device=args.device, repeats=args.repeats)
    return _emit(run_reversible_benchmark(config, progress=log), args)


def _emit(records: list[dict], args: argparse.Namespace, table: Callable[[list[dict]], str] | None = None) -> int:
    """Write a benchmark's records (``--json``, or stdout) and log their table, where it has one."""
    emit_json(records, args.json, log=log)
    if table is not None:
        log(table(records))
    return 0


def _methods(args: argparse.Namespace) -> list[str]:
    """``--methods``: specs separated by ';' (or ',' without options)."""
    from .._specs import split_specs

    return split_specs(args.methods)


def _budget(args: argparse.Namespace) -> float | int:
    """``--budget``: a fraction of the keys (<= 1) or a count (> 1)."""
    return args.budget if args.budget <= 1 else int(args.budget)


def run_report(args: argparse.Namespace) -> int:
    from ..bench.report import attention_table, decode_table, reversible_table

    records = read_json(args.json, f"--json {args.json!r} is not a file")
    if not isinstance(records, list) or not records or not isinstance(records[0], dict):
        raise ValueError(f"{args.json} must hold a non-empty list of benchmark records")
    reversible = "depth" in records[0]
    if "speedup_vs_dense" in records[0] and "median_s" in records[0]:
        from ..bench.prefill import prefill_table

        print(prefill_table(records))
        return 0
    if "amortized_ms" in records[0]:
        from ..bench.retrieval import retrieval_table

        print(retrieval_table(records))
        return 0
    if "ms_per_token" in records[0]:
        print(decode_table(records))
        return 0
    print(reversible_table(records) if reversible else attention_table(records))
    if args.plot:
        if reversible:
            raise ValueError("--plot is for bench attention records")
        from ..bench.plot import plot_attention_benchmark

        log(f"wrote {plot_attention_benchmark(records, args.plot)}")
    return 0
