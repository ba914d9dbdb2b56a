"""Issue 35, confinement: every tag and file name read from a checkpoint stays inside its folder, and every
metadata entry matches the tensor it names before anything is loaded or written.

Each row is a checkpoint crafted here by hand (a world-1 stage-1 engine on a tiny MLP saves the genuine
one; its ``metadata.json`` is then edited and its SHA-256 recomputed: it carries no key). A load must be
refused with one CheckpointError line and leave the engine's weights (module parameters and fp32 masters)
exactly as they were; ``shardspeed convert`` and ``consolidate`` must exit 1 with one line on stderr and
change no byte outside their output folder (every file under the test's root is compared before and after).
One process runs every case (the CLI through ``shardspeed.cli.main``); one real subprocess checks the
command end to end.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import traceback

import pytest
import torch
from distributed import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 1}}
BIAS = "layers.0.bias"  # 32 elements; loaded last (stages 0-2 hold pieces in gradient order)
GOOD = "good"


# ---- crafting ---------------------------------------------------------------------------------------------
def _read_meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "metadata.json")) as f:
        return json.load(f)


def _write_meta(ckpt: str, d: dict) -> None:
    from shardspeed.checkpoint.metadata import metadata_checksum

    d["checksum"] = metadata_checksum(d)
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(d, f)


def _tensor_file(path: str, t: torch.Tensor) -> dict:
    """A safetensors file holding ``t`` under the key ``k``: its ``files`` record and the tensor's CRC."""
    from shardspeed.checkpoint.format import write_safetensors

    w = write_safetensors(path, [("k", t)])
    return {"info": {"rank": 0, "bytes": w.bytes, "crc32": w.crc32, "header_crc32": w.header_crc32},
            "crc": w.tensor_crc32["k"]}


def _craft(root: str, case: str, file: str, made: dict, listed: bool = True, crc="keep", shape=None) -> str:
    """A copy of the genuine checkpoint whose entry for BIAS's weights names ``file`` (key ``k``)."""
    ckpt = os.path.join(root, case, GOOD)
    shutil.copytree(os.path.join(root, "save", GOOD), ckpt)  # root/case/good: load_checkpoint(root/case, GOOD)
    d = _read_meta(ckpt)
    if listed:
        d["files"][file] = made["info"]
    for e in d["entries"]:
        if e[0] == BIAS and e[1] == "":
            e[4], e[5], e[6] = file, "k", made["crc"] if crc == "keep" else crc
            if shape is not None:
                e[3] = shape[0]
    if shape is not None:
        d["tensors"][BIAS]["shape"] = shape
    _write_meta(ckpt, d)
    return ckpt


def _at(cases: dict, name: str, ckpt: str) -> None:
    cases[name] = (os.path.dirname(ckpt), os.path.basename(ckpt))


def _make_cases(root: str) -> dict:
    """Every hostile checkpoint: name -> (load_dir, tag) (tag None: ``load_dir/latest``)."""
    seven = torch.full((32,), 7.0)
    evil = _tensor_file(os.path.join(root, "evil.safetensors"), seven)  # outside every checkpoint
    cases = {}
    shutil.copytree(os.path.join(root, "save", GOOD), os.path.join(root, "proj"))  # a sibling: a real checkpoint
    os.makedirs(os.path.join(root, "lat"))
    with open(os.path.join(root, "lat", "latest"), "w") as f:
        f.write("../proj")
    cases["latest ../proj"] = (os.path.join(root, "lat"), None)
    cases["tag ../proj"] = (os.path.join(root, "save"), "../proj")
    _at(cases, "file ../../x", _craft(root, "dotdot", "../../evil.safetensors", evil))
    _at(cases, "file absolute", _craft(root, "abs", os.path.join(root, "evil.safetensors"), evil))
    ckpt = _craft(root, "unlisted", "evil.safetensors", evil, listed=False)
    shutil.copy(os.path.join(root, "evil.safetensors"), ckpt)
    _at(cases, "file not under 'files'", ckpt)
    ckpt = _craft(root, "link", "link.safetensors", evil)
    os.symlink(os.path.join(root, "evil.safetensors"), os.path.join(ckpt, "link.safetensors"))
    _at(cases, "symlink out", ckpt)
    ckpt = _craft(root, "nullcrc", "extra.safetensors", evil, crc=None)
    shutil.copy(os.path.join(root, "evil.safetensors"), os.path.join(ckpt, "extra.safetensors"))
    _at(cases, "crc32 null", ckpt)
    for case, t, shape in (("short", torch.tensor([7.0]), None), ("bcast", torch.tensor([7.0], dtype=torch.float64),
                                                                    None),
                           ("big", torch.tensor([7.0], dtype=torch.float64), [1 << 22])):
        os.makedirs(os.path.join(root, case))
        made = _tensor_file(os.path.join(root, case, "extra.safetensors"), t)
        ckpt = _craft(root, case, "extra.safetensors", made, shape=shape)
        shutil.move(os.path.join(root, case, "extra.safetensors"), os.path.join(ckpt, "extra.safetensors"))
        _at(cases, f"[0, n) -> 1 element ({case})", ckpt)
    return cases


# ---- observing ----------------------------------------------------------------------------------------------
def _weights(engine) -> dict:
    from shardspeed.checkpoint.engine_view import EngineView

    out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, pc in enumerate(pc for ps in EngineView(engine).pieces() for pc in ps):
        out[f"master{i}"] = pc.master.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tree(root: str) -> dict:
    """Every path under ``root`` (links as their target's name) with its bytes."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            if os.path.islink(p):
                out[p] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = f.read()
            else:
                out[p] = "dir"
    return out


def _cli(root: str, out: str, argv: list) -> dict:
    """``shardspeed`` with ``argv`` in this process: exit code, stderr, traceback (if it raised), and the paths
    outside ``out`` it changed."""
    from shardspeed.cli import main

    before = _tree(root)
    err, rc, tb = io.StringIO(), None, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            tb = traceback.format_exc()
    after = _tree(root)
    changed = sorted(p for p in set(before) | set(after)
                     if before.get(p) != after.get(p) and not (p + os.sep).startswith(out + os.sep))
    return {"rc": rc, "stderr": err.getvalue(), "tb": tb, "changed": changed,
            "out": sorted(os.listdir(out)) if os.path.isdir(out) else None}


def _group(root: str) -> dict:
    from models import make_batches, make_model

    import shardspeed
    from shardspeed.errors import CheckpointError

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the export imports deepspeed (its pickled classes)
    engine, *_ = shardspeed.initialize(model=make_model("mlp", 0), config=CFG)

    def train(steps: int, seed: int) -> None:
        for x, y in make_batches("mlp", steps, 2, seed=seed):
            engine.backward(engine(x, y))
            engine.step()

    train(2, 1)
    engine.save_checkpoint(os.path.join(root, "save"), tag=GOOD)
    train(1, 2)  # the engine now differs from every checkpoint here
    res: dict = {"save_tags": {}, "load": {}, "cli": {}}
    for tag in (" ", "\n"):
        try:
            engine.save_checkpoint(os.path.join(root, "tags"), tag=tag)
            res["save_tags"][tag] = None
        except CheckpointError as exc:
            res["save_tags"][tag] = str(exc)
    res["tags_dir"] = sorted(os.listdir(os.path.join(root, "tags"))) if os.path.isdir(os.path.join(root, "tags")) \
        else []

    cases = _make_cases(root)
    for name, (load_dir, tag) in cases.items():
        before = _weights(engine)
        try:
            engine.load_checkpoint(load_dir, tag=tag)
            err = None
        except CheckpointError as exc:
            err = str(exc)
        res["load"][name] = {"error": err, "unchanged": _same(before, _weights(engine))}

    with open(os.path.join(root, "save", "latest"), "w") as f:
        f.write(GOOD + "\n")  # as written by hand: stripped on reading, as DeepSpeed does
    before = _weights(engine)
    path, _ = engine.load_checkpoint(os.path.join(root, "save"))
    res["genuine"] = {"path": path, "changed": not _same(before, _weights(engine))}

    def cli(name: str, argv: list, out: str) -> None:
        res["cli"][name] = _cli(root, out, argv)

    dst = os.path.join(root, "dst")
    cli("convert ours: latest ../proj", ["convert", os.path.join(root, "lat"), dst, "--world", "1", "--stage", "1"],
        dst)
    cli("convert ours: --out-tag ../x", ["convert", os.path.join(root, "save"), dst, "--world", "1", "--stage", "1",
                                         "--out-tag", "../x"], dst)
    ds = os.path.join(root, "ds")  # DeepSpeed's layout, written by a genuine export
    cli("export", ["convert", os.path.join(root, "save"), ds, "--world", "1", "--stage", "1"], ds)
    os.makedirs(os.path.join(root, "dsrc"))
    with open(os.path.join(root, "dsrc", "latest"), "w") as f:
        f.write(f"../ds/{GOOD}")
    cli("convert deepspeed: latest ../ds/good", ["convert", os.path.join(root, "dsrc"), dst], dst)
    cli("convert deepspeed: --out-tag ../y", ["convert", ds, dst, "--out-tag", "../y"], dst)
    for case in ("latest ../proj", "file ../../x", "[0, n) -> 1 element (bcast)", "[0, n) -> 1 element (big)"):
        load_dir, tag = cases[case]
        out = os.path.join(root, "consolidated")
        cli(f"consolidate: {case}", ["consolidate", load_dir, out] + ([] if tag is None else ["--tag", tag]), out)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile"))
    return root, run_distributed(_group, 1, root, timeout=300.0)[0]


LOAD_ROWS = {
    "latest ../proj": "invalid checkpoint tag '../proj'",
    "tag ../proj": "invalid checkpoint tag '../proj'",
    "file ../../x": "names the file '../../evil.safetensors': only plain file names",
    "file absolute": "only plain file names inside the checkpoint directory",
    "file not under 'files'": "names the file 'evil.safetensors', which is not listed under 'files'",
    "symlink out": "a link to",
    "crc32 null": "null or missing checksum",
    "[0, n) -> 1 element (short)": "which holds 1 element(s)",
    "[0, n) -> 1 element (bcast)": "which holds 1 element(s)",
    "[0, n) -> 1 element (big)": "its tensors have",
}


@pytest.mark.parametrize("case", list(LOAD_ROWS))
def test_load_refuses_and_changes_nothing(runs, case):
    r = runs[1]["load"][case]
    assert r["error"] is not None and LOAD_ROWS[case] in r["error"], r
    assert "\n" not in r["error"]
    assert r["unchanged"], f"{case}: the engine's weights changed on a refused load"


def test_genuine_checkpoint_still_loads(runs):
    """The control: the untouched checkpoint (its ``latest`` ending in a newline) loads and changes the weights."""
    assert runs[1]["genuine"] == {"path": os.path.join(runs[0], "save", GOOD), "changed": True}


@pytest.mark.parametrize("tag", [" ", "\n"])
def test_blank_tags_refused_at_save(runs, tag):
    err = runs[1]["save_tags"][tag]
    assert err is not None and "invalid checkpoint tag" in err
    assert runs[1]["tags_dir"] == []  # nothing saved, not even a temporary folder


CLI_ROWS = {
    "convert ours: latest ../proj": "invalid checkpoint tag '../proj'",
    "convert ours: --out-tag ../x": "--out-tag names an invalid checkpoint tag '../x'",
    "convert deepspeed: latest ../ds/good": "invalid checkpoint tag '../ds/good'",
    "convert deepspeed: --out-tag ../y": "--out-tag names an invalid checkpoint tag '../y'",
    "consolidate: latest ../proj": "invalid checkpoint tag '../proj'",
    "consolidate: file ../../x": "only plain file names",
    "consolidate: [0, n) -> 1 element (bcast)": "which holds 1 element(s)",
    "consolidate: [0, n) -> 1 element (big)": "its tensors have",
}


@pytest.mark.parametrize("case", list(CLI_ROWS))
def test_cli_refuses_and_writes_nothing(runs, case):
    r = runs[1]["cli"][case]
    assert r["tb"] is None, r["tb"]
    assert r["rc"] == 1, r
    lines = r["stderr"].splitlines()
    assert len(lines) == 1 and CLI_ROWS[case] in lines[0], r["stderr"]
    assert r["changed"] == [], f"{case}: changed outside its output folder: {r['changed']}"
    assert not r["out"], f"{case}: wrote {r['out']}"


def test_genuine_export_still_works(runs):
    r = runs[1]["cli"]["export"]
    assert r["tb"] is None and r["rc"] == 0, r
    assert r["changed"] == [] and sorted(r["out"]) == ["good", "latest"]


def test_cli_end_to_end(runs, tmp_path):
    """The real command: exit code 1, one line on stderr, no traceback."""
    root = runs[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "shardspeed.cli", "convert", os.path.join(root, "save"),
                           str(tmp_path / "out"), "--tag", "../proj", "--world", "1", "--stage", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "shardspeed convert: error: --tag names an invalid checkpoint tag '../proj': use a plain directory name "
        "such as 'global_step100' (no '/', '..', whitespace at either end or control characters)"]
    assert not (tmp_path / "out").exists()


def test_tag_rules(tmp_path):
    """The one check every tag passes through: plain names pass unchanged, the rest are refused."""
    from shardspeed.checkpoint.commit import check_tag, read_latest
    from shardspeed.errors import CheckpointError

    for tag in ("global_step100", "run-1.final", "été", "a b"):
        assert check_tag(tag) == tag
    for tag in ("", " ", "\n", "\t", ".", "..", "../x", "/abs", "a/b", "latest", "x.tmp-1", "x.old-1", " x",
                "x\n", "a\x00b", "a\x1bb"):
        with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
            check_tag(tag)
    (tmp_path / "latest").write_text("global_step7\n")
    assert read_latest(str(tmp_path)) == "global_step7"  # stripped, as DeepSpeed reads it
    for text in ("", "\n", "../x\n"):
        (tmp_path / "latest").write_text(text)
        with pytest.raises(CheckpointError, match="latest names an invalid checkpoint tag"):
            read_latest(str(tmp_path))
    (tmp_path / "latest").write_bytes(b"x" * 5000)
    with pytest.raises(CheckpointError, match="over 4096 bytes"):
        read_latest(str(tmp_path))
