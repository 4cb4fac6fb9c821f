"""CPU time of the library's hot paths (every mechanism's layer, causal and not, and the decoding steps), for a
before/after comparison of a change: run it alternately on two checkouts, each a fresh process, so that other
processes sharing the machine change the timings less than wall time would (time.process_time, one thread).
Prints one JSON record per measurement; ``cpu_time_ab_summary.py`` turns the records into a table.

    PYTHONPATH=<checkout>/src OMP_NUM_THREADS=1 python docs/scripts/cpu_time_ab.py LABEL >> records.jsonl
    ONLY="sliding-window@1024,cluster-select@1024" ...   # only these non-causal layers
    ONLY=decode ...                                       # only the decode steps
"""
# ruff: noqa: B023 -- each closure is timed inside the iteration that defines it

import json
import os
import statistics
import sys
import time

import torch

from clusterformer.attention import build


def cpu_ms(fn, warmup=2, repeats=7):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def main(label: str) -> None:
    torch.set_num_threads(1)
    records = []
    g = torch.Generator().manual_seed(0)
    MECHANISMS = (("full", {}, False), ("clustered", {}, False), ("improved-clustered", {}, False),
                  ("neural-clustering", {}, False), ("sliding-window", {}, False), ("cluster-select", {}, False),
                  ("lsh", {}, False), ("cluster-former", {}, False),
                  ("full", {}, True), ("sliding-window", {}, True), ("cluster-select", {}, True),
                  ("neural-clustering", {"causal_mode": "strict"}, True))
    ONLY = [tuple(item.split("@")) for item in os.environ.get("ONLY", "").split(",") if item]  # "name@N": a re-check
    DECODE_ONLY = ONLY == [("decode",)]  # ONLY=decode: the decode steps alone
    for name, options, causal in MECHANISMS:
        for n in (1024, 4096):
            if DECODE_ONLY or (ONLY and ((name, str(n)) not in ONLY or causal)):
                continue
            torch.manual_seed(0)
            layer = build(name, dim=256, heads=4, **options)
            x = torch.randn(2, n, 256, generator=g)
            pad = torch.zeros(2, n, dtype=torch.bool)
            pad[1, n * 3 // 4:] = True

            def fwd():
                with torch.no_grad():
                    layer(x, key_padding_mask=pad, causal=causal)

            def fwd_bwd():
                layer(x.requires_grad_(), key_padding_mask=pad, causal=causal).sum().backward()

            what = f"layer {name}{' causal' if causal else ''} N={n}"
            records.append({"what": f"{what} fwd", "cpu_ms": cpu_ms(fwd)})
            records.append({"what": f"{what} fwd+bwd", "cpu_ms": cpu_ms(fwd_bwd, repeats=5)})

    try:  # the AttentionInterface's cached decoding step (SmolLM2's shapes: 9 / 3 heads, head size 64)
        from transformers import AttentionInterface

        from clusterformer.hf import register_attention
    except ImportError:
        AttentionInterface = None
    if AttentionInterface is not None and (DECODE_ONLY or not ONLY):
        class Cache:
            pass

        for method in ("sink-window", "cluster-retrieval"):
            name = register_attention(method, name=f"ab-{method}", budget=0.1)
            function = AttentionInterface()[name]

            class Attention(torch.nn.Module):
                is_causal = True
                num_key_value_groups = 3

                def forward(self, q, k, v, cache=None):
                    return function(self, q, k, v, None, scaling=0.125)

            for n in (4096, 16384):
                module, cache = Attention(), Cache()
                k, v = torch.randn(1, 3, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
                state = {"k": k, "v": v}

                def step():
                    state["k"] = torch.cat([state["k"], torch.randn(1, 3, 1, 64, generator=g)], 2)
                    state["v"] = torch.cat([state["v"], torch.randn(1, 3, 1, 64, generator=g)], 2)
                    with torch.no_grad():
                        module(torch.randn(1, 9, 1, 64, generator=g), state["k"], state["v"], cache=cache)

                step()  # builds the index
                records.append({"what": f"decode {method} n={n} step", "cpu_ms": cpu_ms(step, warmup=2, repeats=31)})

    for record in records:
        print(json.dumps({"label": label, **record}))


if __name__ == "__main__":
    main(sys.argv[1])
