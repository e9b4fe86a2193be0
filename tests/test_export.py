"""The Hugging Face export against `transformers` itself: logits, greedy generation, LoRA, tokenizer, RoPE, refusals."""
import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from test_cli import GQA, snapshot, tiny_lm
from tiny_lm.checkpoint import Checkpointer, load_checkpoint, run_meta
from tiny_lm.errors import TinyLMError
from tiny_lm.export import export_hf, save_hf
from tiny_lm.generate import generate
from tiny_lm.model import ModelConfig, Transformer, add_lora, apply_rope, rope_angles
from tiny_lm.tokenizer import tokenizer_fingerprint

# GQA: 2 layers, 4 query heads sharing 2 key/value heads: query head h reads key/value head h // 2 in both libraries
TOLERANCE = 1e-4  # max |logit difference| between tiny_lm and transformers, both in float32


def save_run(folder, model, tok, init_from: dict | None = None):
    """A run folder as `tiny-lm train` leaves it, with one weights-only step of `model` (a LoRA model: its adapters, and `init_from` its base)."""
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"model": model.cfg.to_dict(), **({"init_from": init_from} if init_from else {})}
    ckpt = Checkpointer(folder, meta={"config": config, "tokenizer_fingerprint": tokenizer_fingerprint(tok)})
    ckpt(1, model, None)
    ckpt.wait()
    ckpt.close()
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step GQA run (test_cli's: its compiled programs), LoRA adapters on it (random, with α/r = 2: a fine-tune
    through the command line would cost another compile of the training step and leave the adapters near zero), and
    both exported."""
    root = tmp_path_factory.mktemp("export")
    r = tiny_lm("train", *GQA, "--max-steps", "4", "--output-dir", str(root / "base"))
    assert r.returncode == 0, r.stderr
    base, tok, _ = load_checkpoint(root / "base")
    adapted = add_lora(base, rank=4, alpha=8.0)
    rng = np.random.default_rng(0)
    nnx.update(adapted, jax.tree.map(lambda x: x + rng.normal(0, 0.05, x.shape).astype(np.float32), nnx.state(adapted, nnx.LoRAParam)))
    save_run(root / "lora", adapted, tok, init_from={"path": str(root / "base"), "step": run_meta(root / "base")[1]})
    for name in ("base", "lora"):
        assert export_hf(root / name, root / f"hf_{name}") == root / f"hf_{name}"
    return root


def load_hf(folder):
    """The exported folder through `transformers`' Auto classes, in float32; every tensor must be used."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))  # compiled once per shape (eager JAX compiles every op per shape)


def max_logit_diff(model, hf_model, ids_BT) -> float:
    with torch.no_grad():
        theirs = hf_model(torch.tensor(ids_BT)).logits.numpy()
    return float(np.abs(np.asarray(forward(model, ids_BT)) - theirs).max())


def prompts(cfg: ModelConfig, seed: int = 0) -> list:
    """Random token prompts of several lengths, the last a full `seq_len` window."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, (b, t)) for b, t in [(1, 1), (2, 9), (3, cfg.seq_len)]]


def greedy(model, ids: list, n: int) -> list:
    """tiny_lm's greedy continuation (`len(ids) + n <= seq_len`): argmax over the whole context, right-padded to one shape."""
    ids, window_1T = list(ids), np.zeros((1, model.cfg.seq_len), np.int32)
    for _ in range(n):
        window_1T[0, : len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(forward(model, window_1T))[0, len(ids) - 1])))
    return ids


@pytest.mark.parametrize("name", ["base", "lora"])
def test_logits_match_transformers(runs, name):
    model, _, cfg = load_checkpoint(runs / name)
    hf_model, _ = load_hf(runs / f"hf_{name}")
    assert (hf_model.config.num_attention_heads, hf_model.config.num_key_value_heads) == (4, 2)
    diff = max(max_logit_diff(model, hf_model, ids) for ids in prompts(cfg))
    print(f"\n{name} run (lora_rank {cfg.lora_rank}): max |logits tiny_lm - transformers| = {diff:.2e}")
    assert diff < TOLERANCE


def test_lora_export_is_merged(runs):
    """The LoRA export holds the adapted model: plain Llama tensors, logits that differ from the base's."""
    names = set(transformers.AutoModelForCausalLM.from_pretrained(runs / "hf_lora").state_dict())
    assert names == set(transformers.AutoModelForCausalLM.from_pretrained(runs / "hf_base").state_dict())
    base, lora = (load_checkpoint(runs / name)[0] for name in ("base", "lora"))
    ids = prompts(base.cfg)[-1]
    assert np.abs(np.asarray(forward(base, ids)) - np.asarray(forward(lora, ids))).max() > 100 * TOLERANCE  # the adapters changed something


@pytest.mark.parametrize("prompt", ["ROMEO:", ""])
def test_greedy_generation_matches(runs, prompt):
    model, tok, cfg = load_checkpoint(runs / "base")
    hf_model, hf_tok = load_hf(runs / "hf_base")
    eot = tok.token_to_id("<|endoftext|>")
    ids = tok.encode(prompt, add_special_tokens=False).ids or [eot]  # an empty prompt starts from <|endoftext|>, as tiny-lm generate does
    n = cfg.seq_len - len(ids)  # within the window: past seq_len tiny_lm slides it and transformers does not
    ours = greedy(model, ids, n)
    assert prompt + tok.decode(ours[len(ids):]) == generate(model, tok, prompt, max_new_tokens=n, temperature=0, stop_at_eot=False)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=n)[0].tolist()
    if len(theirs) < len(ours):  # generate stops at the end of the document (generation_config.json's eos)
        assert theirs[-1] == eot
    assert theirs == ours[: len(theirs)] and len(theirs) > len(ids)


def test_untied_embeddings_and_other_shapes(runs, tmp_path):
    """Untied output projection, 3 of 6 heads, a non-default MLP width and RoPE base, random norm scales: still equal."""
    tok = load_checkpoint(runs / "base")[1]
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), seq_len=64, d_model=48, n_layer=2, n_head=6, n_kv_head=3, d_ff=80,
                      rope_theta=500.0, tie_embeddings=False)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: x + rng.normal(0, 0.1, x.shape).astype(np.float32), nnx.state(model)))
    hf_model, _ = load_hf(save_hf(model, tok, tmp_path / "hf"))
    assert not hf_model.config.tie_word_embeddings
    diff = max(max_logit_diff(model, hf_model, ids) for ids in prompts(cfg, seed=1))
    print(f"\nuntied, 6 heads / 3 kv heads, d_ff 80, theta 500: max |logits tiny_lm - transformers| = {diff:.2e}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("name,switches", [
    ("qwen3", dict(qk_norm=True, use_swiglu=True)),  # tied
    ("qwen3", dict(qk_norm=True, use_swiglu=True, tie_embeddings=False, zero_init=True)),
    ("arcee", dict(tie_embeddings=False)),  # the default MLP: two matrices, ReLU²
    ("arcee", dict(activation="gelu")),  # jax.nn.gelu is transformers' gelu_pytorch_tanh
    ("llama", dict(use_swiglu=True, tie_embeddings=False, zero_init=True))])
def test_switches_match_their_transformers_class(runs, tmp_path, name, switches):
    """SwiGLU with QK-norm exports as Qwen3, the two-matrix MLP as Arcee, SwiGLU as Llama: the same logits
    (every parameter perturbed, so the zero-initialised ones and the QK-norm scales carry signal)."""
    tok = load_checkpoint(runs / "base")[1]
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), seq_len=32, d_model=48, n_layer=2, n_head=6, n_kv_head=3, **switches)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    nnx.update(model, jax.tree.map(lambda x: x + rng.normal(0, 0.1, x.shape).astype(np.float32), nnx.state(model)))
    hf_model, _ = load_hf(save_hf(model, tok, tmp_path / "hf"))
    assert hf_model.config.model_type == name and hf_model.config.tie_word_embeddings == cfg.tie_embeddings
    diff = max(max_logit_diff(model, hf_model, ids) for ids in prompts(cfg, seed=2))
    print(f"\n{name} {switches}: max |logits tiny_lm - transformers| = {diff:.2e}")
    assert diff < TOLERANCE


def test_rope_pairing_is_transformers(runs):
    """tiny_lm's apply_rope is transformers' apply_rotary_pos_emb with the exported config's angles: no permutation."""
    config = transformers.AutoConfig.from_pretrained(runs / "hf_base")
    B, T, H, K = 2, 200, 3, config.head_dim  # positions well past seq_len too
    x_BTHK = np.random.default_rng(0).normal(size=(B, T, H, K)).astype(np.float32)
    ours = np.asarray(apply_rope(x_BTHK, *rope_angles(np.arange(T), K, config.rope_parameters["rope_theta"])))
    x_BHTK = torch.tensor(x_BTHK).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(config)(x_BHTK, torch.arange(T)[None].expand(B, T))
    theirs, _ = apply_rotary_pos_emb(x_BHTK, x_BHTK, cos, sin)
    np.testing.assert_allclose(ours, theirs.transpose(1, 2).numpy(), atol=1e-5)


def test_tokenizer_round_trip(runs):
    _, tok, _ = load_checkpoint(runs / "base")
    _, hf_tok = load_hf(runs / "hf_base")
    assert (hf_tok.eos_token, hf_tok.eos_token_id, hf_tok.bos_token) == ("<|endoftext|>", tok.token_to_id("<|endoftext|>"), "<|endoftext|>")
    texts = ["ROMEO:\nWhat light through yonder window breaks? It is the east , and Juliet is the sun .",
             "  two  spaces, tabs\tand\n\nblank lines ", "héllo wörld ✓ 日本語 🙂", "one<|endoftext|>two", ""]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok.decode(ids) == text


@pytest.mark.parametrize("switches,flag", [(dict(use_rmsnorm=False), "--no-rmsnorm"), (dict(use_rope=False), "--no-rope"),
                                           (dict(logit_softcap=15.0), "--logit-softcap"),
                                           (dict(qk_norm=True), "--qk-norm or add --swiglu")])
def test_refuses_what_no_class_can_express(runs, tmp_path, switches, flag):
    """One line naming the part and the fix, before the weights are read (here they are gone) and before anything is written."""
    tok = load_checkpoint(runs / "base")[1]
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), seq_len=32, d_model=32, n_layer=1, n_head=2, **switches)
    run = save_run(tmp_path / "run", Transformer(cfg, rngs=nnx.Rngs(0)), tok)
    for f in (run / "checkpoint_step_1" / "model").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    before = snapshot(tmp_path)
    with pytest.raises(TinyLMError, match=f"^cannot export .*: retrain with.* \\(drop {re.escape(flag)}\\)$") as e:
        export_hf(run, tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert snapshot(tmp_path) == before


def test_existing_folder_needs_overwrite(runs, tmp_path):
    out = tmp_path / "hf"
    export_hf(runs / "base", out)
    (out / "stale.txt").write_text("from an earlier export")
    before = snapshot(tmp_path)
    with pytest.raises(TinyLMError, match="exists: pass --overwrite to replace it"):
        export_hf(runs / "lora", out)
    assert snapshot(tmp_path) == before
    export_hf(runs / "lora", out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").read_bytes() == (runs / "hf_lora" / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((runs / "hf_lora" / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or old folder left beside it
    with pytest.raises(TinyLMError, match="not a model folder"):
        export_hf(runs / "base", runs / "lora", overwrite=True)  # --overwrite never replaces a run
