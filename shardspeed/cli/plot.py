"""``shardspeed plot``: the CSV monitor's loss, LR and throughput into a PNG (:mod:`shardspeed.monitor.csv_plot`)."""

from __future__ import annotations

import argparse
import sys


def _cmd_plot(args: argparse.Namespace) -> int:
    from ..monitor.csv_plot import PlotError, plot_run

    try:
        out = plot_run(args.run_dir, args.output)
    except (PlotError, OSError) as e:
        print(f"shardspeed plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw loss, LR and throughput from the CSV monitor into a PNG",
                       description="Read the csv_monitor files of a run ({output_path}/{job_name}/"
                                   "Train_Samples_*.csv) and draw loss, LR and throughput panels into a PNG.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job directory, or an output_path with one job")
    p.add_argument("-o", "--output", help="the PNG to write (default: RUN_DIR's job directory/training.png)")
    p.set_defaults(func=_cmd_plot)
