"""The opt-in ``deepspeed`` package (shardspeed/compat): found only when asked, DeepSpeed's version in its
metadata, ``deepspeed.X`` is ``shardspeed.X`` itself, missing names fail with the one line, and the import
starts nothing."""
import os
import subprocess
import sys

import shardspeed
from shardspeed.compat import DEEPSPEED_VERSION, active, site_path

PROBE = r"""
import importlib.metadata, importlib.util, json, sys
import deepspeed, shardspeed, torch
import deepspeed.runtime.engine as de, shardspeed.runtime.engine as se
out = {"version": deepspeed.__version__, "meta": importlib.metadata.version("deepspeed"),
       "origin": importlib.util.find_spec("deepspeed").origin, "same_module": de is se,
       "same_init": deepspeed.initialize is shardspeed.initialize, "same_zero": deepspeed.zero.Init is shardspeed.zero.Init,
       "hasattr_missing": hasattr(deepspeed, "no_such_name"), "pg": torch.distributed.is_initialized(),
       "cuda": torch.cuda.is_initialized()}
try:
    import deepspeed.inference.v2
except ImportError as e:
    out["module_error"] = [type(e).__name__, str(e)]
try:
    deepspeed.no_such_name
except AttributeError as e:
    out["name_error"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def _probe(env_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (env_path, os.getcwd()) if p))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_package_resolves_to_shardspeed_only_when_asked():
    assert not active()  # the test process sees the installed DeepSpeed (or none): nothing shadows it
    got = _probe(site_path())
    assert got["version"] == got["meta"] == DEEPSPEED_VERSION
    assert got["origin"].startswith(site_path())
    assert got["same_module"] and got["same_init"] and got["same_zero"]
    assert got["hasattr_missing"] is False
    assert got["module_error"] == ["NotProvidedModuleError",
                                   "shardspeed's deepspeed compatibility does not provide deepspeed.inference"]
    assert got["name_error"] == ["NotProvidedError",
                                 "shardspeed's deepspeed compatibility does not provide deepspeed.no_such_name"]
    assert got["pg"] is False and got["cuda"] is False


def test_version_passes_the_integrations_gates():
    from packaging.version import Version
    v = Version(DEEPSPEED_VERSION)
    assert v >= Version("0.16.4") and v.local is not None and v.local.startswith("shardspeed")
    meta = [d for d in os.listdir(site_path()) if d.endswith(".dist-info")]
    assert meta == [f"deepspeed-{DEEPSPEED_VERSION}.dist-info"]
    with open(os.path.join(site_path(), meta[0], "METADATA")) as f:
        assert f"Version: {DEEPSPEED_VERSION}\n" in f.read()


def test_missing_top_level_name_is_one_line():
    try:
        shardspeed.no_such_name  # noqa: B018
    except AttributeError as e:
        assert str(e) == "shardspeed's deepspeed compatibility does not provide deepspeed.no_such_name"
    else:
        raise AssertionError("no error")


def test_from_import_of_a_missing_name_keeps_the_line():
    """``from deepspeed import X`` would become Python's generic "cannot import name"; ours says the line, and
    ``hasattr`` still answers False."""
    import pytest

    from shardspeed.errors import NotProvidedImportError
    with pytest.raises(NotProvidedImportError, match="does not provide deepspeed.init_inference$"):
        from shardspeed import init_inference  # noqa: F401
    with pytest.raises(NotProvidedImportError, match="does not provide deepspeed.ops.adam.NoSuchOptimizer$"):
        from shardspeed.ops.adam import NoSuchOptimizer  # noqa: F401
    assert not hasattr(shardspeed, "init_inference")
    from shardspeed import DeepSpeedEngine, get_accelerator  # DeepSpeed's top-level names, imported when asked
    from shardspeed.runtime.engine import Engine
    assert DeepSpeedEngine is Engine and get_accelerator().device_name() in ("cpu", "cuda")
