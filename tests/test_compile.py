"""`tiny-lm compile` with the real compilers of a TPU and a GPU, on this CPU (nbs/08d_compile).

The compilers are installed apart from the test environment (tests/check.sh puts them in TINY_LM_COMPILERS with
`pip install --target`): with libtpu installed, every JAX program on the machine first looks for a TPU and prints
errors where there is none, so only these commands get them, on their PYTHONPATH. Each test compiles a small model
(nano or tiny, a few sequences a device) so that the five targets take about a minute of CPU in all.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import ENV, in_process

COMPILERS = os.environ.get("TINY_LM_COMPILERS", "")
HAVE = bool(COMPILERS) and (Path(COMPILERS) / "libtpu").is_dir() and (Path(COMPILERS) / "jax_plugins").is_dir()
needs_compilers = pytest.mark.skipif(not HAVE, reason="the compilers could not be installed here (tests/check.sh "
                                                      "installs them into TINY_LM_COMPILERS; it said why)")
WITH = {**ENV, "PYTHONPATH": COMPILERS}
WITHOUT = {k: v for k, v in ENV.items() if k not in ("PYTHONPATH", "TINY_LM_COMPILERS")}


def compile_run(*flags, env=WITH) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiny_lm", "compile", *flags], capture_output=True, text=True,
                          env=env, timeout=600)


def report(*flags) -> dict:
    r = compile_run(*flags, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


FIELDS = {"memory", "device_memory", "estimated_memory", "flops", "bytes_accessed", "attention", "while_loops", "fits",
          "seconds_lower_bound"}
ADAMW = ["--optimizer", "adamw", "--steps-per-call", "1"]  # one optimizer step a call: its FLOPs are the model's


def matmul_flops(n_layer, d_model, d_ff, vocab, tokens) -> float:
    "Training FLOPs of the matrix products of a plain (non-SwiGLU) model: 6 × their weights × tokens."
    return 6 * (n_layer * (4 * d_model**2 + 2 * d_model * d_ff) + d_model * vocab) * tokens


@needs_compilers
def test_a_tpu_v5e_chip_compiles_the_planned_programs():
    r = report("--profile", "tpu-v5e", "--model-preset", "tiny", "--vocab-size", "4096", "--batch-size", "8", *ADAMW)
    train, generate = r["train"], r["generate"]
    assert FIELDS <= set(train) and FIELDS <= set(generate)
    assert r["device"] == "TPU v5 lite" and train["fits"] and train["device_memory"] == 15.75 * 2**30
    assert train["attention"] == "splash"  # the Pallas kernel, compiled by libtpu
    assert [loop["trips"] for loop in train["while_loops"]] == [4, 4]  # the 4 layers, forward and backward
    # the compiled program's matrix products, counted per trip, are the model's: 6 × weights × tokens
    assert train["flops"] == pytest.approx(matmul_flops(4, 128, 384, 4096, 8 * 128), rel=0.01)
    assert 0 < train["memory"]["total"] < train["estimated_memory"] * 2
    assert [loop["trips"] for loop in generate["while_loops"]] == [16]  # the decode chunk's loop, of known length
    # per token, the call's 16 divided: about the bf16 weights once (libtpu keeps some of so small a model on chip)
    assert 1.18e6 < generate["bytes_accessed"] < 8 * 1.18e6


@needs_compilers
def test_a_v6e_chip_and_a_v5e_slice_of_four():
    v6e = report("--profile", "tpu-v6e", "--model-preset", "nano", "--batch-size", "4", "--no-generate", *ADAMW)
    assert v6e["device"] == "TPU v6 lite" and v6e["train"]["device_memory"] == 31.25 * 2**30
    slice4 = report("--profile", "tpu-v5e", "--devices", "4", "--model-preset", "nano", "--batch-size", "4",
                    "--no-generate", *ADAMW)
    train = slice4["train"]
    assert slice4["num_devices"] == 4 and train["mesh"] == {"data": 4, "fsdp": 1} and train["attention"] == "splash"
    # per device, a chip of the slice does one chip's work at its 4 sequences: the nano preset's products
    assert train["flops"] == pytest.approx(matmul_flops(4, 64, 192, 4096, 4 * 128), rel=0.01)
    assert train["tokens_per_device"] == 4 * 128


@needs_compilers
def test_an_h100_and_eight_a100s():
    h100 = report("--profile", "h100", "--model-preset", "tiny", "--vocab-size", "4096", "--batch-size", "8", *ADAMW)
    train = h100["train"]
    assert train["attention"] == "cudnn" and train["fits"]  # cuDNN's flash kernel, as on the device
    assert train["flops"] == pytest.approx(matmul_flops(4, 128, 384, 4096, 8 * 128), rel=0.01)
    assert train["device_memory"] == int(79.6 * 2**30 * 0.75)  # JAX's allocator's share
    # decoding at batch 1 reads little more than each bf16 weight once a token (07_generate, 15_performance)
    generate, params = h100["generate"], h100["generate"]["params"]
    assert [loop["trips"] for loop in generate["while_loops"]] == [16]
    assert 2 * params < generate["bytes_accessed"] < 3.5 * params, generate["bytes_accessed"] / params
    a100s = report("--profile", "a100-40gb", "--devices", "8", "--model-preset", "nano", "--batch-size", "2",
                   "--no-generate", *ADAMW)
    assert a100s["num_devices"] == 8 and a100s["train"]["mesh"] == {"data": 8, "fsdp": 1}
    assert a100s["device"] == "NVIDIA A100-SXM4-40GB" and a100s["train"]["attention"] == "cudnn"


@needs_compilers
def test_what_does_not_fit_is_one_line():
    tpu = compile_run("--profile", "tpu-v5e", "--model-preset", "nano", "--seq-len", "1024", "--batch-size", "4096",
                      "--no-generate", *ADAMW)  # AdamW: Muon's iterations would only add compiling
    assert tpu.returncode == 2 and "Traceback" not in tpu.stderr, tpu.stderr[-2000:]
    line = tpu.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the training step does not fit there: RESOURCE_EXHAUSTED") and "exceeds" in line
    gpu = compile_run("--profile", "h100", "--model-preset", "nano", "--seq-len", "1024", "--batch-size", "16384",
                      "--no-generate", "--json", *ADAMW)
    assert gpu.returncode == 2 and json.loads(gpu.stdout)["train"]["fits"] is False  # the report, then the error
    assert gpu.stderr.strip().splitlines()[-1].startswith("error: the training step needs")


def test_without_the_compilers_it_says_what_to_install():
    r = compile_run("--profile", "tpu-v5e", env=WITHOUT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "pip install" in r.stderr and '"libtpu==' in r.stderr, r.stderr


@pytest.mark.parametrize("flags, says", [
    (["--profile", "cpu"], "tiny-lm compile needs a --profile to compile for"),
    (["--profile", "t4"], "tiny-lm compile needs a --profile to compile for"),
    (["--profile", "tpu-v5e", "--devices", "3"], "power of two"),
    (["--profile", "h100", "--devices", "0"], "--devices must be at least 1"),
])
def test_bad_targets_are_one_line(flags, says):
    r = in_process("compile", *flags)  # refused before the compilers are looked for: this process has none
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


LOGITS = """
import math, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
from dataclasses import replace
from types import SimpleNamespace
from tiny_lm.compile import compile_lowered, hlo_arrays, lower_train, parse_hlo, target_devices, target_mesh
from tiny_lm.cpu import named_kernels
from tiny_lm.profiles import HARDWARE, usable_memory
from tiny_lm.sizing import preset_config
from tiny_lm.target import building_for
from tiny_lm.train import TrainConfig
hw, B = HARDWARE["h100"], 8
cfg = replace(preset_config("nano", 16384), dtype="bfloat16")
with building_for(SimpleNamespace(**vars(hw.device()), memory_bytes=usable_memory(hw))):
    mesh = target_mesh(target_devices(hw, 1), cfg, B, usable_memory(hw), "cudnn")
    with named_kernels():  # as `bench train --trace` compiles: the GPU compiler takes its option (no command buffers)
        step = lower_train(cfg, TrainConfig(batch_size=B, optimizer="adamw", steps_per_call=1), mesh)
    text = compile_lowered(step, "the training step").as_text()
computations, entry = parse_hlo(text)
logits = B * cfg.seq_len * cfg.vocab_size
kept = [t for i in computations[entry] for t, dims, _ in hlo_arrays(i.shape) if math.prod(dims) == logits]
table = cfg.vocab_size * cfg.d_model  # the tied embedding: a kernel of no inputs that makes one fills it
filled = [i.name for i in computations[entry] if not i.operands and i.opcode not in ("parameter", "constant")
          and any(math.prod(dims) == table for _, dims, _ in hlo_arrays(i.shape))]
print(kept.count("f32"), kept.count("bf16"), len(filled))
"""


@needs_compilers
def test_the_loss_keeps_no_float32_logits_on_a_gpu():
    ("GPT-2-sized vocabularies made float32 `[B, T, V]` buffers of 2.5 GB each; the loss's own gradient makes none, "
     "and the tied embedding's gradient is not scattered into a zero-filled `[V, D]` table (01_model's compute_copy). "
     "Compiled as `bench train --trace` compiles a GPU's step: the GPU compiler accepts `named_kernels`' option.")
    r = subprocess.run([sys.executable, "-c", LOGITS], capture_output=True, text=True, env=WITH, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    f32, bf16, filled = map(int, r.stdout.split())
    assert f32 == 0 and bf16 > 0  # the logits and their gradient exist, in bf16 only
    assert filled == 0  # the embedding's lookup adds its gradient into the head's, not into a table of zeros
