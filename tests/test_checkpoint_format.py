"""Checkpoint format version 2: per entry the global layer index and an N-dimensional slice (offsets and
lengths per dimension) beside the flat range; version-1 checkpoints still load. Also the checkpoint's
coordination goes through Collectives (counted in the comms log)."""
from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint.metadata import (
    METADATA_FILE,
    VERSION,
    CheckpointMetadata,
    Entry,
    flat_range_to_box,
    layer_of,
)
from shardspeed.errors import CheckpointError


def _boxes(shape):
    """Every N-D box of ``shape`` whose elements are one contiguous flat range: {(start, end): box}."""
    out = {}
    numel = math.prod(shape)
    idx = torch.arange(numel).view(shape) if shape else torch.arange(1).view(())
    ranges = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in shape]
    for combo in itertools.product(*ranges):
        sl = tuple(slice(o, o + n) for o, n in combo)
        flat = idx[sl].reshape(-1)
        a, b = int(flat[0]), int(flat[-1]) + 1
        if b - a == flat.numel():
            out[(a, b)] = ([o for o, _ in combo], [n for _, n in combo])
    return out


@pytest.mark.parametrize("shape", [(), (5,), (4, 3), (3, 1, 4), (2, 3, 2), (1, 5), (4, 1)])
def test_flat_range_to_box_finds_every_box_and_only_boxes(shape):
    numel = math.prod(shape)
    boxes = _boxes(shape)
    idx = torch.arange(numel).view(shape) if shape else torch.arange(1).view(())
    for a in range(numel):
        for b in range(a + 1, numel + 1):
            got = flat_range_to_box(shape, a, b)
            assert (got is not None) == ((a, b) in boxes), (shape, a, b, got)
            if got is not None:
                offsets, lengths = got
                assert len(offsets) == len(lengths) == len(shape)
                sl = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
                assert idx[sl].reshape(-1).tolist() == list(range(a, b))


def test_whole_and_empty_tensors():
    assert flat_range_to_box((4, 3), 0, 12) == ([0, 0], [4, 3])
    assert flat_range_to_box((0, 3), 0, 0) == ([0, 0], [0, 3])
    assert flat_range_to_box((), 0, 1) == ([], [])
    assert flat_range_to_box((4, 3), 2, 2) is None  # an empty piece of a non-empty tensor: no box


def test_layer_of():
    assert layer_of("layers.3.attn.weight") == 3
    assert layer_of("h.10.mlp.0.weight") == 10
    assert layer_of("0.weight") == 0
    assert layer_of("wte.weight") is None
    assert layer_of("ln_f.bias") is None


def _v1_json(meta: CheckpointMetadata) -> str:
    """The same description in format version 1: 9-field entries, no layer or N-D slice."""
    d = json.loads(meta.to_json())
    d["version"] = 1
    d["entries"] = [e[:9] for e in d["entries"]]
    del d["checksum"]  # format 3's: versions 1 and 2 have no metadata checksum and no header CRCs
    for f in d["files"].values():
        del f["header_crc32"]
    return json.dumps(d)


def test_version1_metadata_reads_with_derived_geometry():
    tensors = {"layers.1.weight": {"shape": [4, 3], "dtype": "float32", "kind": "param"}}
    d = {"format": "shardspeed.checkpoint", "version": 1, "tag": "t", "world_size": 2, "zero_stage": 2,
         "train_dtype": "float32", "tensors": tensors, "aliases": {}, "files": {}, "optimizer": None, "rng": {},
         "entries": [["layers.1.weight", "", 0, 6, "rank00000.safetensors", "w/a", 1, 1, None],
                     ["layers.1.weight", "exp_avg", 6, 11, "rank00001.safetensors", "o/b", 2, 1, None]]}
    meta = CheckpointMetadata.from_json(json.dumps(d))
    assert meta.version == 1
    e0, e1 = meta.entries
    assert (e0.layer, e0.offsets, e0.lengths) == (1, [0, 0], [2, 3])
    assert (e1.layer, e1.offsets, e1.lengths) == (1, None, None)  # [6, 11) of a 4x3 tensor is not a box
    d["version"] = VERSION + 1
    with pytest.raises(CheckpointError, match="upgrade shardspeed"):
        CheckpointMetadata.from_json(json.dumps(d))


def test_entry_json_round_trip():
    e = Entry("layers.2.weight", "exp_avg", 3, 6, "f", "k", 7, True, None, layer=2, offsets=[1, 0], lengths=[1, 3])
    assert Entry.from_json(json.loads(json.dumps(e.to_json()))) == e


def _v1_case(tmp: str):
    """Save (format 2), check the new fields, rewrite the checkpoint as format 1, load it into a fresh
    engine, and compare with loading the format-2 copy."""
    import shutil

    import torch.distributed as dist

    import shardspeed
    from shardspeed.checkpoint.engine_view import EngineView

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}}
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=cfg)
    for b in make_batches("mlp", 2, 8):
        engine.backward(engine(*micro_batch(b, rank, world, 0, 1)))
        engine.step()
    before = {op: s["count"] for op, s in engine.comms_summary().items()}
    path = engine.save_checkpoint(tmp, tag="v2")
    after = engine.comms_summary()
    object_ops = {op: after[op]["count"] - before.get(op, 0) for op in ("all_gather_object", "broadcast_object")}
    out = {"object_ops": object_ops}
    if rank == 0:
        with open(os.path.join(path, METADATA_FILE)) as f:
            raw = json.load(f)
        meta = CheckpointMetadata.from_json(json.dumps(raw))
        out["version"] = raw["version"]
        out["fields"] = sorted({len(e) for e in raw["entries"]})
        boxes_ok, n_boxes = True, 0
        for e in meta.entries:  # every recorded N-D slice holds exactly the entry's flat range
            shape = meta.tensors[e.tensor].shape
            if e.offsets is None:
                boxes_ok &= flat_range_to_box(shape, e.start, e.end) is None
                continue
            n_boxes += 1
            idx = torch.arange(math.prod(shape)).view(shape)
            sl = tuple(slice(o, o + n) for o, n in zip(e.offsets, e.lengths))
            boxes_ok &= idx[sl].reshape(-1).tolist() == list(range(e.start, e.end))
        out["boxes_ok"] = boxes_ok and n_boxes > 0
        out["rows"] = [(e.offsets, e.lengths) for e in meta.entries if e.tensor == "layers.2.weight" and e.state == ""]
        out["layers"] = sorted({(e.tensor, e.layer) for e in meta.entries if e.state == ""})
        v1 = os.path.join(tmp, "v1")
        shutil.copytree(path, v1)
        with open(os.path.join(v1, METADATA_FILE), "w") as f:
            f.write(_v1_json(meta))
    dist.barrier()
    results = {}
    for tag in ("v2", "v1"):
        torch.manual_seed(123)
        fresh, *_ = shardspeed.initialize(model=make_model("mlp", seed=5), config=cfg)
        fresh.load_checkpoint(tmp, tag=tag)
        v = EngineView(fresh)
        results[tag] = {
            "masters": [pc.master.clone() for pieces in v.pieces() for pc in pieces],
            "state": [{k: t.clone() for k, t in fresh.optimizer.state[pc.master].items()}
                      for pieces in v.pieces() for pc in pieces],
            "steps": fresh.global_steps,
        }
    same = all(torch.equal(a, b) for a, b in zip(results["v1"]["masters"], results["v2"]["masters"]))
    same_state = all(sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
                     for sa, sb in zip(results["v1"]["state"], results["v2"]["state"]))
    ref = EngineView(engine)
    equal_to_saved = all(torch.equal(a, pc.master) for a, pc in
                         zip(results["v1"]["masters"], [pc for pieces in ref.pieces() for pc in pieces]))
    out.update(v1_equals_v2=same, v1_state_equals_v2=same_state, equal_to_saved=equal_to_saved,
               steps=results["v1"]["steps"])
    return out


def test_version1_checkpoint_loads_like_version2(tmp_path):
    res = run_distributed(_v1_case, 2, str(tmp_path))
    r0 = res[0]
    assert r0["version"] == VERSION == 4
    assert r0["fields"] == [12]
    assert r0["boxes_ok"]
    # stage 2 at world 2 splits the 8x32 weight of layers.2 into two halves of 4 rows each
    assert sorted(r0["rows"]) == [([0, 0], [4, 32]), ([4, 0], [4, 32])]
    assert ("layers.0.weight", 0) in r0["layers"] and ("layers.2.bias", 2) in r0["layers"]
    for r in res:
        assert r["v1_equals_v2"] and r["v1_state_equals_v2"] and r["equal_to_saved"]
        assert r["steps"] == 2
        # coordination: one broadcast (the temporary directory) and four all-gathers (errors, records, commit)
        assert r["object_ops"]["broadcast_object"] == 1
        assert r["object_ops"]["all_gather_object"] >= 3
    # and the format-1 copy consolidates offline
    from shardspeed.checkpoint import consolidate, load_consolidated

    consolidate(str(tmp_path / "v1"), str(tmp_path / "out1"))
    consolidate(str(tmp_path / "v2"), str(tmp_path / "out2"))
    a, b = load_consolidated(str(tmp_path / "out1")), load_consolidated(str(tmp_path / "out2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n1,n2", [(0, 0), (1, 0), (0, 7), (13, 1), (4096, 12345), (3, 1 << 20)])
def test_crc32_combine_is_the_crc_of_the_concatenation(n1, n2):
    import zlib

    from shardspeed.checkpoint.format import crc32_combine

    g = torch.Generator().manual_seed(n1 * 31 + n2)
    a = torch.randint(0, 256, (n1,), dtype=torch.uint8, generator=g).numpy().tobytes()
    b = torch.randint(0, 256, (n2,), dtype=torch.uint8, generator=g).numpy().tobytes()
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_written_file_records_the_crc_of_its_bytes(tmp_path):
    """The writer passes over each tensor's bytes once; the whole file's CRC-32 it records, combined from the
    header's and the tensors', is zlib's over the file as written (as are the header's and each tensor's)."""
    import zlib

    from shardspeed.checkpoint.format import write_safetensors

    g = torch.Generator().manual_seed(0)
    items = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randint(0, 9, (7,), generator=g)),
             ("c", torch.randn(0)), ("d", torch.randn(11, generator=g).to(torch.bfloat16))]
    path = str(tmp_path / "x.safetensors")
    w = write_safetensors(path, items, metadata={"k": "v"})
    data = open(path, "rb").read()
    assert w.bytes == len(data) and w.crc32 == zlib.crc32(data)
    head = 8 + int.from_bytes(data[:8], "little")
    assert w.header_crc32 == zlib.crc32(data[:head])
    header = json.loads(data[8:head])
    for key, _ in items:
        lo, hi = header[key]["data_offsets"]
        assert w.tensor_crc32[key] == zlib.crc32(data[head + lo : head + hi])


def test_the_checkpoint_crc32_is_zlibs():
    """Whichever CRC-32 the format uses (zlib-ng's when installed), it gives zlib's values, with a running value."""
    import zlib

    from shardspeed.checkpoint.format import crc32

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    b = data.numpy().tobytes()
    assert crc32(b) == zlib.crc32(b) and crc32(b[7:], crc32(b[:7])) == zlib.crc32(b)
