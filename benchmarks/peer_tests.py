"""Issue 37: the peers' own DeepSpeed tests, run against the real DeepSpeed and against shardspeed's opt-in
``deepspeed`` package, with a pass / fail / skip table per test file and the reason for each test that passes
on DeepSpeed and not on ours.

    # DeepSpeed's unit tests (its harness: tests/unit/common.py), from a DeepSpeed checkout's tests/ folder
    python benchmarks/peer_tests.py --suite deepspeed --tests /tmp/peers/ds/tests \\
        unit/runtime/test_ds_config_model.py unit/checkpoint/test_latest_checkpoint.py -- -k "not fp16"
    # accelerate's tests/deepspeed (from its repository's tests/ folder)
    python benchmarks/peer_tests.py --suite accelerate --tests /tmp/peers/acc/tests --hub-standins \\
        deepspeed/test_deepspeed.py deepspeed/test_deepspeed_gradient_accumulation.py
    # transformers' tests/deepspeed (from its repository's root: the tests import ``tests.trainer``)
    python benchmarks/peer_tests.py --suite transformers --tests /tmp/peers/tf tests/deepspeed/test_deepspeed.py

Nothing is fetched: give the folder of the peer's tests (``git archive <tag> tests | tar -x`` of DeepSpeed,
accelerate or transformers). Backends (``--backends``, default all three):
  - ``deepspeed``: the installed DeepSpeed (plain PYTHONPATH, ``DS_ACCELERATOR=cpu``);
  - ``package``: ``PYTHONPATH=$(shardspeed deepspeed-path):<checkout>``: every ``import deepspeed`` in the
    tests, in their harness and in the library under test (accelerate, transformers) is shardspeed's package;
  - ``shim``: the installed DeepSpeed with only ``deepspeed.initialize``, ``deepspeed.zero.Init`` and
    ``deepspeed.zero.GatheredParameters`` replaced by shardspeed's (a ``sitecustomize.py`` written to a
    temporary folder put first on PYTHONPATH, so the harness's spawned workers get it too): the issue's
    first measurement, kept for comparison. The package now runs DeepSpeed's harness unchanged
    (``tests/unit/common.py``: ``deepspeed.accelerator``, ``deepspeed.comm``, its ``file://`` rendezvous).
Results: a JUnit XML and the verbose log per backend and ``peer_tests-<suite>.json`` in ``--out``; the table
on stdout. A run stopped early (DeepSpeed's harness ends the session with ``pytest.exit`` when a test hangs past
``DS_UNITTEST_TIMEOUT``, 300 s here; ``--timeout`` interrupts the whole run) writes no XML: its outcomes are read
from the log, without reasons. A file that cannot be collected (a name the package lacks) counts as one
failure and the other files still run (``--continue-on-collection-errors``). Other options:
  - ``--hub-standins``: the Hub models the peers' tests load, as tiny random models of the same classes in an
    offline cache (this box has no network; what the tests check is the plumbing, not the weights);
  - ``--check-imports``: run nothing, list each file's ``deepspeed`` imports that fail on the package;
  - ``--report-only --out DIR1,DIR2,...``: the union of earlier runs (e.g. of different files), an XML record
    winning over a log-only one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = '''"""peer_tests.py shim: DeepSpeed's modules and harness, with the entry points under test swapped."""
import os
if os.environ.get("SHARDSPEED_PEER_SHIM") == "1":
    import deepspeed  # deepspeed.zero is an attribute of the package (runtime.zero), not a module
    import shardspeed
    import shardspeed.zero
    deepspeed.initialize = shardspeed.initialize
    deepspeed.zero.Init = shardspeed.zero.Init
    deepspeed.zero.GatheredParameters = shardspeed.zero.GatheredParameters
'''
GPU_SKIP = re.compile(r"gpu|cuda|accelerator|nccl|fp16|half|multi.?device|more than one|device count|"
                      r"requires? (a )?torch_?(multi_)?accelerator|hardware|triton|async.?io|aio", re.I)


STANDINS = r"""
import os, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJModel, T5Config, T5ForConditionalGeneration
hub = os.path.join(sys.argv[1], "hub")
models = {"sshleifer/tiny-gpt2": (GPT2LMHeadModel, GPT2Config(n_embd=2, n_layer=2, n_head=2, n_positions=1024)),
          "hf-internal-testing/tiny-random-gpt2": (GPT2LMHeadModel, GPT2Config(n_embd=32, n_layer=2, n_head=4,
                                                   vocab_size=1000, n_positions=512)),
          "patrickvonplaten/t5-tiny-random": (T5ForConditionalGeneration, T5Config(d_model=64, d_ff=64, d_kv=8,
                                              num_layers=2, num_heads=2, vocab_size=32128)),
          "hf-internal-testing/tiny-random-gptj": (GPTJModel, GPTJConfig(n_embd=32, n_layer=2, n_head=4,
                                                   rotary_dim=4, vocab_size=1000, n_positions=512))}
for repo, (cls, config) in models.items():
    snap = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots", "0" * 40)
    os.makedirs(os.path.join(os.path.dirname(os.path.dirname(snap)), "refs"), exist_ok=True)
    with open(os.path.join(os.path.dirname(os.path.dirname(snap)), "refs", "main"), "w") as f:
        f.write("0" * 40)
    torch.manual_seed(0)
    cls(config).save_pretrained(snap)
"""


def make_standins(hf_home: str) -> None:
    """Tiny random models under the Hub names the peers' tests load, in an offline HF cache (this box has no
    network). Same classes as the Hub's tiny models, random weights: what the tests check is the DeepSpeed
    plumbing, not the weights."""
    subprocess.run([sys.executable, "-c", STANDINS, hf_home], check=True, env=dict(os.environ, PYTHONPATH=ROOT))


def site_path() -> str:
    out = subprocess.run([sys.executable, "-m", "shardspeed.cli", "deepspeed-path"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return out.stdout.strip().splitlines()[-1]


def backend_env(name: str, shim_dir: str, suite: str, tests: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_UNITTEST_TIMEOUT=os.environ.get("DS_UNITTEST_TIMEOUT", "300"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("SHARDSPEED_PEER_SHIM", None)
    paths = {"deepspeed": [ROOT], "package": [site_path(), ROOT], "shim": [shim_dir, ROOT]}[name]
    if suite == "transformers":
        paths.append(tests)  # its tests import ``tests.trainer.test_trainer`` from the repository root
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if name == "shim":
        env["SHARDSPEED_PEER_SHIM"] = "1"
    if os.path.isdir(os.path.join(shim_dir, "hf_home")):
        env["HF_HOME"] = os.path.join(shim_dir, "hf_home")
    return env


def run_backend(name: str, args, shim_dir: str) -> tuple[str, float, int]:
    xml = os.path.join(args.out, f"{args.suite}-{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={xml}", "-q", "-rN", "--continue-on-collection-errors", *args.files, *args.pytest_args]
    t0 = time.time()
    log = os.path.join(args.out, f"{args.suite}-{name}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=args.tests, env=backend_env(name, shim_dir, args.suite, args.tests),
                                stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # interrupt, so that pytest still writes the XML of what ran
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = -1
    return xml, time.time() - t0, rc


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def file_of(classname: str, tests: str) -> str:
    """The test file of a JUnit classname (``unit.runtime.test_x.TestY``) when the XML has no file attribute."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        if os.path.isfile(os.path.join(tests, *parts[:n]) + ".py"):
            return "/".join(parts[:n]) + ".py"
    return classname.replace(".", "/") + ".py"


def parse(xml: str, tests: str) -> dict[str, dict]:
    """test id -> {file, outcome, reason}."""
    if not os.path.exists(xml):
        return {}
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("file") or file_of(case.get("classname", ""), tests)
        tid = f"{file}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = first_line(el.get("message")) or first_line(el.text)
                if tag != "skipped":
                    reason = error_line(el.text) or reason
                break
        out[tid] = {"file": file, "outcome": outcome, "reason": reason}
    return out


LOG_LINE = re.compile(r"^(\S+\.py)::(\S+?)(?:::(\S+))? .*?(PASSED|FAILED|SKIPPED|ERROR)")
FROM_LOG = "(from the log: no reason recorded)"
SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (\S+\.py)::(\S+) - (.*)$")


def parse_log(log: str) -> dict[str, dict]:
    """Outcomes from a verbose pytest log, for a run stopped before it wrote its XML (a hung test ends
    DeepSpeed's harness with pytest.exit; a run past --timeout is interrupted). Reasons only where the
    short summary got written."""
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    out: dict[str, dict] = {}
    reasons = {}
    with open(log, errors="replace") as f:
        for raw in f:
            line = ansi.sub("", raw.rstrip())
            m = SUMMARY_LINE.match(line)
            if m:
                reasons[f"{m.group(2)}::{m.group(3)}"] = m.group(4)[:300]
                continue
            m = LOG_LINE.match(line)
            if m:
                file, cls, name, status = m.groups()
                tid = f"{file}::{cls}::{name}" if name else f"{file}::{file.rsplit('/', 1)[-1][:-3]}::{cls}"
                out[tid] = {"file": file, "outcome": status.lower().replace("error", "error"), "reason": "",
                            "key": f"{file}::{cls}" + (f"::{name}" if name else "")}
    for r in out.values():
        r["reason"] = reasons.get(r.pop("key"), FROM_LOG)
        if r["outcome"] == "passed":
            r["reason"] = ""
    return out


def error_line(text: str | None) -> str:
    """The traceback's last ``E   `` line naming an exception (the one-line reason)."""
    lines = [ln[1:].strip() for ln in (text or "").splitlines() if ln.startswith("E ")]
    named = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Exit|Failed|Interrupt)\b", ln)]
    return (named or lines or [""])[-1][:300]


def read_run(xml: str, tests: str) -> dict[str, dict]:
    got = parse(xml, tests)
    log = xml[:-4] + ".log"
    if not got and os.path.exists(log):  # no XML (stopped early): what the log shows ran
        got = parse_log(log)
    return got


def tally(results: dict[str, dict]) -> dict[str, list[int]]:
    per: dict[str, list[int]] = {}
    for r in results.values():
        row = per.setdefault(r["file"], [0, 0, 0])
        row[{"passed": 0, "failed": 1, "error": 1, "skipped": 2}[r["outcome"]]] += 1
    return per


def report(runs: dict[str, dict], times: dict[str, tuple[float, int]]) -> str:
    names = list(runs)
    files = sorted({f for res in runs.values() for f in tally(res)})
    lines = ["| test file | " + " | ".join(f"{n} pass/fail/skip" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for f in files:
        cells = ["/".join(map(str, tally(runs[n]).get(f, ["-"] * 3))) for n in names]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    total = [[sum(t[i] for t in tally(runs[n]).values()) for i in range(3)] for n in names]
    lines.append("| **all** | " + " | ".join("/".join(map(str, t)) for t in total) + " |")
    lines.append("| wall time (s), rc | " + " | ".join(f"{times[n][0]:.0f}, {times[n][1]}" for n in names) + " |")
    ref = runs.get("deepspeed", {})
    for n in names:
        if n == "deepspeed":
            continue
        bad = [(t, r) for t, r in runs[n].items()
               if r["outcome"] in ("failed", "error") and ref.get(t, {}).get("outcome") == "passed"]
        lines.append(f"\npasses on deepspeed, fails on {n}: {len(bad)}")
        lines += [f"  {t}: {r['reason']}" for t, r in sorted(bad)]
    skips: dict[str, int] = {}
    for res in runs.values():
        for r in res.values():
            if r["outcome"] == "skipped":
                skips[r["reason"]] = skips.get(r["reason"], 0) + 1
    lines.append("\nskip reasons (all backends; * = only for want of a GPU/accelerator):")
    lines += [f"  {c:4d} {'*' if GPU_SKIP.search(m) else ' '} {m}" for m, c in sorted(skips.items(), key=lambda x: -x[1])]
    return "\n".join(lines)


IMPORTS_PROBE = r"""
import ast, importlib, json, sys
out = {}
for path in sys.argv[1:]:
    tree = ast.parse(open(path).read())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "deepspeed":
            wants = [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            wants = [(a.name, None) for a in node.names if a.name.split(".")[0] == "deepspeed"]
        else:
            continue
        for mod, name in wants:
            try:
                m = importlib.import_module(mod)
                if name is not None and name != "*" and not hasattr(m, name):
                    try:
                        importlib.import_module(mod + "." + name)
                    except ImportError:
                        getattr(m, name)
            except Exception as e:
                bad.append(f"{mod}{'.' + name if name else ''}: {type(e).__name__}")
    out[path] = sorted(set(bad))
print("IMPORTS " + json.dumps(out))
"""


def check_imports(args, shim_dir: str) -> None:
    """Every ``import deepspeed...`` / ``from deepspeed... import`` in the given files, tried on the package."""
    env = backend_env("package", shim_dir, args.suite, args.tests)
    paths = [os.path.join(args.tests, f) for f in args.files]
    out = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, *paths], env=env, cwd=args.tests,
                         capture_output=True, text=True, timeout=args.timeout)
    lines = [x for x in out.stdout.splitlines() if x.startswith("IMPORTS ")]
    if not lines:
        raise SystemExit(out.stderr.strip()[-1000:])
    for path, bad in json.loads(lines[-1][len("IMPORTS "):]).items():
        print(f"{os.path.relpath(path, args.tests)}: {len(bad)} deepspeed imports fail on the package")
        print("".join(f"  {b}\n" for b in bad), end="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("deepspeed", "accelerate", "transformers"), required=True)
    ap.add_argument("--tests", required=True, help="the folder pytest runs in (the peer's tests/ or repo root)")
    ap.add_argument("--backends", default="deepspeed,package,shim")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "peer_tests"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per backend run")
    ap.add_argument("--report-only", action="store_true", help="re-read the XML files in --out, run nothing")
    ap.add_argument("--hub-standins", action="store_true",
                    help="serve the Hub models the tests load (tiny-gpt2, tiny-random-gpt2, t5-tiny-random, "
                         "tiny-random-gptj) as tiny "
                         "random models of the same classes from an offline cache")
    ap.add_argument("--check-imports", action="store_true",
                    help="only list the files' deepspeed imports that fail on the package (no tests run)")
    ap.add_argument("files", nargs="*", help="test files (relative to --tests); after --: pytest's own options")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]
    args.tests = os.path.abspath(args.tests)
    if not args.report_only:
        os.makedirs(args.out, exist_ok=True)
    shim_dir = tempfile.mkdtemp(prefix="peer_shim_")
    with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as f:
        f.write(SHIM)
    if args.hub_standins:
        make_standins(os.path.join(shim_dir, "hf_home"))
    if args.check_imports:
        check_imports(args, shim_dir)
        return
    runs, times = {}, {}
    for name in args.backends.split(","):
        if args.report_only:  # --out may list several folders (runs of different files): their union
            runs[name], times[name] = {}, (0.0, 0)
            for out in args.out.split(","):
                for tid, r in read_run(os.path.join(out, f"{args.suite}-{name}.xml"), args.tests).items():
                    if tid not in runs[name] or not r["reason"].startswith(FROM_LOG):  # an XML record wins
                        runs[name][tid] = r
        else:
            xml, wall, rc = run_backend(name, args, shim_dir)
            runs[name], times[name] = read_run(xml, args.tests), (wall, rc)
    text = report(runs, times)
    print(text)
    with open(os.path.join(args.out.split(",")[0], f"peer_tests-{args.suite}.json"), "w") as f:
        json.dump({"files": args.files, "pytest_args": args.pytest_args, "times": times, "results": runs}, f, indent=1)


if __name__ == "__main__":
    main()
