"""``csv_monitor``: one CSV file per event under ``{output_path}/{job_name}``, as DeepSpeed writes them.

``Train/Samples/lr`` goes to ``Train_Samples_lr.csv`` (``/`` and spaces become ``_``) with the header
``step,lr`` (the part of the name after the last ``/``), then one ``step,value`` row per event, with the csv
module's default ``\\r\\n`` line ends (DeepSpeed's files have them too).
"""
from __future__ import annotations

import csv
import os
from typing import List, Set

from .sink import Event, Sink


def csv_file_name(event_name: str) -> str:
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


def csv_header(event_name: str) -> List[str]:
    return ["step", event_name.rsplit("/", 1)[-1]]


class CSVMonitor(Sink):
    def __init__(self, output_path: str, job_name: str):
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started: Set[str] = set()

    def write_events(self, events: List[Event]) -> None:
        for name, value, step in events:
            path = os.path.join(self.log_dir, csv_file_name(name))
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                # the header once per file: on the first write of this run into a new or empty file (a run
                # appending to an earlier run's file does not repeat it; DeepSpeed's does)
                if path not in self._started:
                    self._started.add(path)
                    if f.tell() == 0:
                        writer.writerow(csv_header(name))
                writer.writerow([step, value])
