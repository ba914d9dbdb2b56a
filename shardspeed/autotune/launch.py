"""The trial launcher: ``python .../shardspeed/autotune/launch.py NPROC script.py [args]`` (stdlib only).

Starts NPROC local ranks of ``script.py`` with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port) and waits for them. It is run as a file, not
imported from the package, so it never imports torch: a trial then costs one start-up per rank instead
of torchrun's agent start-up on top (about 10 s against 27 s per trial on the 2-core test box). The
ranks stay in the launcher's process group, so the tuner's kill of that group reaches all of them; when
one rank fails the launcher kills the others and exits with its code. Training itself is launched with
torchrun (`shardspeed run`, what ``cmd_optimal.txt`` holds).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: launch.py NPROC script.py [args] | launch.py NPROC -m module [args]", file=sys.stderr)
        return 2
    nproc, target = int(argv[0]), argv[1:]
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, *target], env=env))
    code = 0
    while procs:
        for p in list(procs):
            rc = p.poll()
            if rc is None:
                continue
            procs.remove(p)
            if rc != 0 and code == 0:
                code = rc if rc > 0 else 128 - rc
                for other in procs:  # one rank failed: the others would wait on it forever
                    other.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
