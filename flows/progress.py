"""A run's progress as the user watches it: a rich bar on stderr at a terminal, else one plain
line per round (stdout, or stderr under ``--json``), nothing with ``--no-progress``. The
experiment flow (flows/experiment.py) updates it after each round."""

from __future__ import annotations

import sys
import time


class Progress:
    """A run's progress: a rich bar on stderr when stderr is a terminal, else one plain line per
    round (a log file reads as a log): on stdout, or on stderr under ``--json`` (whose stdout
    ends with the summary). Nothing with ``--no-progress``."""

    def __init__(self, total: int, start: int, name: str, enabled: bool, json_out: bool = False):
        self.bar = None
        self.stream = None
        self.total, self.name = total, name
        if not enabled:
            return
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task(name, total=total, completed=start, info="")
            self.bar.start()
        else:
            self.stream = sys.stderr if json_out else sys.stdout
        self.t = time.perf_counter()

    def update(self, row: dict) -> None:
        info = " ".join(f"{k}={row[k]:.3f}" for k in ("accuracy", "loss", "ari") if isinstance(row.get(k), float))
        if self.bar:
            self.bar.update(self.task, completed=row["round"], info=info)
        elif self.stream:
            now = time.perf_counter()
            clusters = f" clusters={row['num_clusters']}" if "num_clusters" in row else ""
            print(f"{time.strftime('%H:%M:%S')} {self.name} round {row['round']}/{self.total} {info}{clusters} "
                  f"{now - self.t:.2f}s", file=self.stream, flush=True)
            self.t = now

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
