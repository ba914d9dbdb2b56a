"""Issue 37: the part of transformers' tests/deepspeed/test_deepspeed.py (v5.24) that can run on a CPU box
without the Hub, against the real DeepSpeed and against shardspeed's opt-in ``deepspeed`` package.

    python benchmarks/peer_transformers_cpu.py            # both backends, one fresh process each

On CPU, transformers' file runs only ``CoreIntegrationDeepSpeed`` (``TrainerIntegrationDeepSpeed`` is
``@require_torch_accelerator`` + ``@require_torch_fp16``, ``TestDeepSpeedWithLauncher`` is ``@slow`` +
``@require_torch_accelerator``), and those tests load tiny models from the Hub, which this box cannot reach.
So this script runs, per backend:
  - ``collect``: the file's module-level imports (``deepspeed.utils.logger``,
    ``deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint``, transformers' integration names)
    and ``is_deepspeed_available()`` -- if these fail, pytest cannot even collect the file;
  - ``test_init_zero3``, ``test_init_zero3_missing_params``, ``test_arange_bf16`` with their asserts, the
    Hub models replaced by tiny models of the same classes built from configs and saved locally.
The single-process "launcher" is the tests' own: MASTER_ADDR/PORT, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peer_tests import make_standins, site_path  # noqa: E402

CASES = r'''
import json, os, re, sys, tempfile
os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import torch
from transformers import AutoModel, logging
from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_available, unset_hf_deepspeed_config
from transformers.testing_utils import CaptureLogger, LoggingLevel

results = {}
def case(fn):
    try:
        fn()
        results[fn.__name__] = ["passed", ""]
    except Exception as e:
        results[fn.__name__] = ["failed", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}"]
    finally:
        unset_hf_deepspeed_config()

# the tests' own Hub names, served from an offline cache of tiny stand-ins (peer_tests.make_standins)
T5 = "patrickvonplaten/t5-tiny-random"
GPT2 = "sshleifer/tiny-gpt2"
GPTJ = "hf-internal-testing/tiny-random-gptj"

def loaded(load):
    with LoggingLevel(logging.INFO):
        logger = logging.get_logger("transformers.modeling_utils")
        with CaptureLogger(logger) as cl:
            model = load()
    return model, cl.out

def collect():
    from deepspeed.utils import logger  # noqa: F401
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint  # noqa: F401
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled  # noqa: F401
    assert is_deepspeed_available(), "is_deepspeed_available() is False"

def test_init_zero3():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    ds_config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    dschf = HfDeepSpeedConfig(ds_config)
    assert dschf.is_zero3() and is_deepspeed_zero3_enabled()
    _, out = loaded(lambda: AutoModel.from_pretrained(T5))
    assert "Detected DeepSpeed ZeRO-3" in out, out[-300:]
    del ds_config["zero_optimization"]
    dschf = HfDeepSpeedConfig(ds_config)
    assert not dschf.is_zero3() and not is_deepspeed_zero3_enabled()
    _, out = loaded(lambda: AutoModel.from_pretrained(T5))
    assert "Detected DeepSpeed ZeRO-3" not in out

def test_init_zero3_missing_params():
    import deepspeed
    from transformers.models.gpt2.modeling_gpt2 import GPT2PreTrainedModel
    class TinyGPT2WithUninitializedWeights(GPT2PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.transformer = AutoModel.from_pretrained(GPT2, config=config)
            self.new_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        def forward(self, *args, **kwargs):
            return self.new_head(self.transformer(*args, **kwargs)[0]).float()
        def _init_weights(self, module):
            super()._init_weights(module)
            if module is self.new_head:
                self.new_head.weight.data.fill_(-100.0)
                self.new_head.bias.data.fill_(+100.0)
    ds_config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    HfDeepSpeedConfig(ds_config)
    model, out = loaded(lambda: TinyGPT2WithUninitializedWeights.from_pretrained(GPT2))
    assert "Detected DeepSpeed ZeRO-3" in out
    assert re.search(r"newly initialized.*new_head\.bias.*new_head\.weight", out), out[-300:]
    with deepspeed.zero.GatheredParameters([model.new_head.weight, model.new_head.bias]):
        assert torch.allclose(model.new_head.weight, torch.tensor(-100.0))
        assert torch.allclose(model.new_head.bias, torch.tensor(+100.0))
    del ds_config["zero_optimization"]
    HfDeepSpeedConfig(ds_config)
    model, out = loaded(lambda: TinyGPT2WithUninitializedWeights.from_pretrained(GPT2))
    assert "Detected DeepSpeed ZeRO-3" not in out
    assert torch.allclose(model.new_head.weight, torch.tensor(-100.0))

def test_arange_bf16():
    ds_config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    HfDeepSpeedConfig(ds_config)
    model, out = loaded(lambda: AutoModel.from_pretrained(GPTJ))
    assert "Detected DeepSpeed ZeRO-3" in out, "no 'Detected DeepSpeed ZeRO-3' in the log"
    assert str(model.h[0].attn.q_proj.weight.dtype) == "torch.bfloat16", model.h[0].attn.q_proj.weight.dtype
    import transformers.models.gptj.modeling_gptj as gptj
    good = gptj.create_sinusoidal_positions(model.config.max_position_embeddings, model.config.rotary_dim)
    got = model.h[0].attn.embed_positions
    assert got.dtype == good.dtype, f"embed_positions {got.dtype}, torch's {good.dtype}"
    torch.testing.assert_close(good, got.cpu())

for fn in (collect, test_init_zero3, test_init_zero3_missing_params, test_arange_bf16):
    case(fn)
print("CASES " + json.dumps(results))
'''


def run(pythonpath: str, port: int, hf_home: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", HF_HOME=hf_home)
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-c", CASES, str(port)], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=900)
    lines = [x for x in out.stdout.splitlines() if x.startswith("CASES ")]
    if not lines:
        return {"process": ["failed", (out.stderr.strip().splitlines() or ["no output"])[-1][:240]]}
    return json.loads(lines[-1][len("CASES "):])


def main() -> None:
    hf_home = tempfile.mkdtemp(prefix="peer_hf_")
    make_standins(hf_home)
    got = {"deepspeed": run(ROOT, 29811, hf_home), "package": run(os.pathsep.join([site_path(), ROOT]), 29812, hf_home)}
    names = list(dict.fromkeys(n for r in got.values() for n in r))
    print("| transformers tests/deepspeed, CPU part | deepspeed | shardspeed package |")
    print("|---|---|---|")
    for n in names:
        cells = [got[b].get(n, ["-", ""]) for b in got]
        print(f"| {n} | " + " | ".join(c[0] + (f": {c[1]}" if c[1] else "") for c in cells) + " |")


if __name__ == "__main__":
    main()
