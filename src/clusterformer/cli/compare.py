"""``clusterformer compare``: the papers' comparison across the family -- every mechanism on every task, several
seeds (or CV folds), equal budgets, resumable, several runs at once -- summarised in ``OUT/summary.{json,md}``.

A grid can live in a file (``--grid grids/NAME.json``): a JSON object with any of this command's options by their
long names (``tasks``, ``attention``, ``seeds``, ``folds``, ``options``, ``variants``, ``jobs``,
``keys_per_query``, ``out``, ``train_args``) and a ``description``; a flag given on the command line overrides the
file's value. The grids behind the documented results are in ``grids/``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .._specs import split_specs
from ._args import json_object, log, name_list

# the keys a grid file may hold: the long names of the flags, and a description
GRID_KEYS = ("tasks", "attention", "seeds", "folds", "options", "variants", "jobs", "keys_per_query", "out",
             "train_args", "description")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="every mechanism on every task over seeds/folds (resumable) + summary",
                       description="Run `clusterformer train` for each task x entry x seed (or fold) into "
                                   "OUT/TASK/LABEL/seedS, skipping finished runs and resuming interrupted ones, "
                                   "then write OUT/summary.json and OUT/summary.md. Flags after `--` go to every "
                                   "train run, e.g. -- --epochs 5 --dim 128.")
    p.add_argument("--grid", default=None,
                   help="a grid file (JSON: tasks, attention, seeds, variants, keys_per_query, out, train_args, ...); "
                        "flags given here override its values, e.g. grids/aggregation.json")
    p.add_argument("--tasks", default=None, type=_tasks, help="comma-separated tasks, e.g. mr,cr,wikiqa,listops")
    p.add_argument("--attention", type=_labels, default=None,
                   help="comma-separated mechanisms, or 'all' (every trainable one and cluster-former-stack); an "
                        "entry may carry options, NAME:key=value,... (e.g. neural-clustering:grouping=random; use ';' "
                        "between entries when options hold commas), or be a label defined by --variants; "
                        "cluster-former-stack is the paper's stack (sliding-window layers, the last Cluster-Former)")
    p.add_argument("--seeds", type=_seeds, default=None, help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--folds", type=int, default=None,
                   help="sentence tasks (mr, cr, subj, mpqa): run these CV folds instead of the seeds")
    p.add_argument("--options", default=None, help='attention options per entry as JSON, e.g. '
                                                   '{"lsh": {"chunk_size": 32}}')
    p.add_argument("--variants", default=None,
                   help='labelled variants as JSON: {"LABEL": {"attention": NAME, "options": {...}, "train_args": '
                        '[...]}}, e.g. {"nc-no-losses": {"attention": "neural-clustering", "train_args": '
                        '["--clustering-weight", "0", "--centroid-sorting-weight", "0"]}}; name LABEL in --attention')
    p.add_argument("--jobs", type=int, default=None,
                   help="trainings at once (default 1); with more than one, each gets cpu_count/jobs threads "
                        "unless OMP_NUM_THREADS is set")
    p.add_argument("--keys-per-query", type=int, default=None,
                   help="one budget for every entry: the options that let each query read at most this many keys "
                        "(logits computed: summaries, bounds, scored candidates included) at the runs' --max-len "
                        "(full, clustered and improved-clustered read every key and run as they are); use a new --out "
                        "per budget")
    p.add_argument("--out", default=None, help="comparison directory (required unless the grid file names one)")
    p.add_argument("--plot", default=None, help="also draw the speed-accuracy picture here (PNG)")
    p.add_argument("--summary-only", action="store_true",
                   help="train nothing: write OUT/summary.json and summary.md from the runs of the named entries "
                        "and seeds that have finished (e.g. a grid whose entries ran with different seeds)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for every train run")
    p.set_defaults(func=run)


def _tasks(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _seeds(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def read_grid(path: str | Path) -> dict[str, Any]:
    """A grid file's values, checked: a JSON object whose keys are among :data:`GRID_KEYS`; ``attention`` and
    ``tasks`` may be lists or the flags' text, ``options`` and ``variants`` objects, ``train_args`` a list of
    strings. ``ValueError`` names the file and the key at fault."""
    try:
        grid = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--grid {path}: {error}") from error
    if not isinstance(grid, dict):
        raise ValueError(f"--grid {path}: expected a JSON object, got {type(grid).__name__}")
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise ValueError(f"--grid {path}: unknown key(s) {', '.join(unknown)}; expected among {', '.join(GRID_KEYS)}")
    values: dict[str, Any] = {}
    for key, value in grid.items():
        if key in ("tasks", "attention") and isinstance(value, list):
            value = ";".join(value) if key == "attention" else ",".join(value)
        if key == "tasks":
            value = _tasks(value)
        elif key == "attention":
            value = _labels(value)
        elif key == "seeds":
            value = [int(v) for v in value] if isinstance(value, list) else _seeds(str(value))
        elif key in ("options", "variants") and not isinstance(value, dict):
            raise ValueError(f"--grid {path}: {key} must be a JSON object")
        elif key == "train_args" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"--grid {path}: train_args must be a list of strings")
        values[key] = value
    return values


def _labels(text: str) -> list[str]:
    from ..apps.compare import STACK

    if text.strip() == "all":
        return [*name_list("all"), STACK]
    labels = split_specs(text)
    if not labels:
        raise argparse.ArgumentTypeError(f"expected mechanism names, got {text!r}")
    return labels


def run(args: argparse.Namespace) -> int:
    from ..apps.compare import CompareConfig, plot_comparison, run_comparison

    grid = read_grid(args.grid) if args.grid else {}
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    options = json_object("--options", args.options, '{"lsh": {"chunk_size": 32}}') if args.options else None
    variants = (json_object("--variants", args.variants,
                            '{"nc-no-losses": {"attention": "neural-clustering", "train_args": [...]}}')
                if args.variants else None)

    def pick(name: str, given: Any, default: Any) -> Any:  # the command line, then the grid file, then the default
        return given if given is not None else grid.get(name, default)

    if args.attention is not None:  # a subset of the grid's entries: its other entries' definitions stay unused
        for name in ("options", "variants"):
            if name in grid:
                grid[name] = {label: value for label, value in grid[name].items() if label in args.attention}
    tasks, out = pick("tasks", args.tasks, None), pick("out", args.out, None)
    if not tasks:
        raise ValueError("--tasks is required (or a --grid file with tasks)")
    if not out:
        raise ValueError("--out is required (or a --grid file with out)")
    config = CompareConfig(tasks=tasks, attention=pick("attention", args.attention, _labels("full,neural-clustering")),
                           out=out, seeds=pick("seeds", args.seeds, [0, 1, 2]), folds=pick("folds", args.folds, None),
                           options=pick("options", options, {}), variants=pick("variants", variants, {}),
                           train_args=[*grid.get("train_args", []), *train_args], jobs=pick("jobs", args.jobs, 1),
                           keys_per_query=pick("keys_per_query", args.keys_per_query, None),
                           summary_only=args.summary_only)
    summary = run_comparison(config, log=log)
    if args.plot:
        log(f"wrote {plot_comparison(summary, args.plot)}")
    return 0
