"""``flockfl list``: what there is to run. The project's experiments and partitions, the methods
by family, the datasets, schemes, models and stages, each with a line about it; an algorithm's
paper, hyper-parameters and stages, or a stage's keys (:func:`cmd_list`), printed as text,
JSON or the Markdown table of docs/algorithms.md (:func:`show_list`)."""

from __future__ import annotations

import json

from flockfl.errors import UserError

# what `flockfl list WHAT` lists; `experiments` and `partitions` need a project (a params.yaml)
LISTS = ("algorithms", "experiments", "partitions", "datasets", "schemes", "models", "stages")


def add_parser(sub) -> None:
    lst = sub.add_parser("list", help="what there is to run: the project's experiments and partitions, the methods by "
                                      "family, datasets, schemes, models and stages; flockfl list ALGORITHM shows its "
                                      "paper, hyper-parameters and stages; flockfl list curriculum|pruning|shift a stage's keys")
    lst.add_argument("algorithm", nargs="?", metavar="WHAT",
                     help=f"one of {', '.join(LISTS)}, or an algorithm or stage name")
    lst.add_argument("--params", default="params.yaml")
    lst.add_argument("--json", action="store_true")
    lst.add_argument("--markdown", action="store_true", help="the algorithm table of docs/algorithms.md")
    lst.set_defaults(handler=show_list)


def show_list(args) -> int:
    """``flockfl list``'s handler: prints :func:`cmd_list`'s answer (or the Markdown table)."""
    if args.markdown:
        from flockfl.algorithms import algorithm_table

        print(algorithm_table())
        return 0
    out = cmd_list(args)
    if args.json:
        print(json.dumps(out, default=str))
    elif args.algorithm in LISTS:
        _print_names(out[args.algorithm])
    elif args.algorithm:
        _print_algorithm(out)
    else:
        _print_overview(out)
    return 0


def cmd_list(args) -> dict:
    from flockfl.algorithms import ALGORITHMS, FAMILIES, describe
    from flockfl.errors import did_you_mean
    from flockfl.reference import describe_stage
    from flockfl.stages import STAGES

    stages = [cls.name for cls in STAGES]
    what = args.algorithm
    if what in LISTS:
        return {what: _listing(what, args)}
    if what:
        if what in stages:
            return describe_stage(what)
        if what not in ALGORITHMS:
            raise UserError(f"unknown algorithm or stage {what!r}{did_you_mean(what, [*ALGORITHMS, *stages, *LISTS])}; "
                            f"choose one of {', '.join(sorted(ALGORITHMS))}, a stage ({', '.join(stages)}), or one of "
                            f"{', '.join(LISTS)}")
        return {"family": ALGORITHMS[what].family, **describe(what)}
    if args.project_root is None:
        from flockfl.experiments import no_project_error

        raise no_project_error(what=" to list its experiments and partitions (flockfl list algorithms|datasets|"
                                    "schemes|models|stages work anywhere)")
    out = {k: list(_listing(k, args)) for k in LISTS}
    out["families"] = {f: [n for n in sorted(ALGORITHMS) if ALGORITHMS[n].family == f] for f in FAMILIES}
    return out


def _listing(what: str, args) -> dict[str, str]:
    """One of `flockfl list`'s lists: each name with a line about it."""
    if what in ("experiments", "partitions"):
        from flockfl.experiments import load_params

        entries = load_params(args.params).get(what) or {}
        if what == "partitions":
            return {k: _partition_line(v) for k, v in sorted(entries.items())}
        return {k: f"{((v or {}).get('algorithm') or {}).get('name', 'fedavg')} on "
                   f"{((v or {}).get('partition') or {}).get('name') or ((v or {}).get('dataset') or {}).get('name', '?')}"
                for k, v in sorted(entries.items())}
    if what == "algorithms":
        from flockfl.algorithms import ALGORITHMS

        return {n: f"[{c.family}] {c.paper}" for n, c in sorted(ALGORITHMS.items())}
    if what == "stages":
        from flockfl.stages import STAGES

        return {c.name: _first_line(c) for c in STAGES}
    if what == "datasets":
        from flockfl.data.datasets import LOADERS as table
    elif what == "schemes":
        from flockfl.data.schemes import SCHEMES as table
    else:
        from models import MODELS as table
    return {n: _first_line(v) for n, v in table.items()}


def _partition_line(v: dict) -> str:
    v = v or {}
    part = v.get("partition") or {}
    return f"{(v.get('dataset') or {}).get('name', '?')}, {part.get('scheme', '?')}" + (
        f", {part['num_clients']} clients" if "num_clients" in part else "")


def _first_line(obj, width: int = 110) -> str:
    """The first sentence of ``obj``'s docstring, cut to ``width`` characters."""
    doc = " ".join((getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0].split())
    end = doc.find(". ")
    doc = doc[: end + 1] if 0 < end else doc
    return doc if len(doc) <= width else doc[: width - 1].rstrip() + "…"


def _print_algorithm(d: dict) -> None:
    print(f"{d['name']} ({d.get('family')}{', from ' + d['origin'] if d.get('origin') not in (None, 'built-in') else ''}): "
          f"{d['paper']}")
    print(f"stages it overrides: {', '.join(d['stages']) or 'none (FedAvg)'}")
    print("hyper-parameters (key, default, allowed, symbol, source of the default, meaning [which value, where]):")
    rows = [(h["key"], repr(h["default"]), h["allowed"], h["symbol"], h.get("source") or "–",
             h["meaning"] + (f" [{h['source_note']}]" if h.get("source_note") else "")) for h in d["hyperparameters"]]
    widths = [max(len(r[i]) for r in rows) for i in range(5)] if rows else []
    for r in rows:
        print("  " + "  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])


def _print_names(entries: dict[str, str]) -> None:
    width = max((len(k) for k in entries), default=0)
    for k, v in entries.items():
        print(f"  {k.ljust(width)}  {v}" if v else f"  {k}")


def _print_overview(out: dict) -> None:
    for key in ("experiments", "partitions"):
        print(f"{key}: {', '.join(out[key]) or '(none in params.yaml)'}")
    print("algorithms (flockfl list ALGORITHM for its paper and keys):")
    for fam, names in out["families"].items():
        print(f"  {fam.ljust(12)}  {', '.join(names)}")
    for key in ("datasets", "schemes", "models", "stages"):
        print(f"{key}: {', '.join(out[key])}")
