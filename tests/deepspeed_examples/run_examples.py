"""Run several example scripts one after another in one process group (one launch instead of five).

``python -m torch.distributed.run --standalone --nproc-per-node 2 run_examples.py PLAN.json [--local_rank=N]``
where PLAN.json is ``[[script, [args...]], ...]``. Each script runs as ``__main__`` (``runpy``) with its
own ``sys.argv`` and ``--local_rank=<LOCAL_RANK>`` appended, as DeepSpeed's launcher passes it (a
``--local_rank`` given to this runner, e.g. by ``shardspeed run --as-deepspeed``, is forwarded instead).
Rank 0 prints ``EXAMPLE_BEGIN <i> <script>`` before the i-th script (its ``EXAMPLE_RESULT`` line follows); a
script that raises prints ``EXAMPLE_ERROR <i> <script> <type>: <message>`` (the first line, on any rank) and
the next one runs.
"""
import json
import os
import runpy
import sys
import traceback


def main() -> None:
    plan_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    given = [a for a in sys.argv[1:] if a.startswith("--local_rank")]  # DeepSpeed's launcher puts it first
    local_rank = given[-1] if given else f"--local_rank={os.environ['LOCAL_RANK']}"
    with open(plan_path) as f:
        plan = json.load(f)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    if os.environ.get("RANK", "0") == "0":
        import deepspeed
        print(f"EXAMPLE_DEEPSPEED {deepspeed.__version__}", flush=True)  # which deepspeed the scripts get
    for i, (script, args) in enumerate(plan):
        path = os.path.join(here, script)
        if os.environ.get("RANK", "0") == "0":
            print(f"EXAMPLE_BEGIN {i} {script}", flush=True)
        sys.argv = [path, *args, local_rank]
        try:
            runpy.run_path(path, run_name="__main__")
        except BaseException as e:  # report it and go on with the next script
            traceback.print_exc()
            line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"EXAMPLE_ERROR {i} {script} {type(e).__name__}: {line}", flush=True)


if __name__ == "__main__":
    main()
