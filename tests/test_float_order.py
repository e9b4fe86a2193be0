"""Float checks that hold on any CPU: the comparisons between two programs that sum in different orders (gradient
accumulation 1 vs 4, steps per call 1 vs 2, chunked vs plain loss, 1 device vs all), each run under two XLA CPU
configurations at once: CI's own (8 devices), and another vector ISA (`--xla_cpu_max_isa`), device and thread count;
then each quantity is compared across the two configurations, as another machine would compute it.

Another ISA changes the order of XLA's float32 sums, which is what another machine does: an Intel Xeon with AVX-512
ran the accumulation check of 04c_train (`eps=1e-6` absolute) 2 ulp off the AMD EPYC it was written on. Measured here
on 04c_train's model: losses ≈ 6.26 of two programs or two configurations differ by up to 1.4e-6 (3 ulp; 1 device vs
8 under CI's flags), so that absolute 1e-6 fails; gradients by 6e-7 of their largest entry, parameters after two Adam
steps by 3e-5.

The rules (the notebooks use the same): a loss, a mean of float32 terms, agrees to RTOL relative (a few ulp of 1.2e-7
times the depth of the sum, with room); a tensor agrees to RTOL of its own largest entry (entry by entry a relative
error means nothing near zero); parameters after Adam steps agree to ADAM_ATOL absolute, because Adam divides each
update by the gradient's size, so rounding noise in a gradient near zero moves a parameter by up to a fraction of
the learning rate whatever its magnitude.

    python tests/test_float_order.py OUT.npz   # the worker: computes every pair under this process's XLA_FLAGS
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from test_cli import JAX_CACHE, XLA_BASE

RTOL = 1e-5  # float32 eps 1.2e-7 × a reduction depth of ~10 (sums of 2^8-2^10 terms) × ~8 of room
NORM_RTOL = 1e-4  # a sum of squares of ~10^5 gradients, sequential on a CPU: eps × sqrt(n) × a few
ADAM_ATOL = 1e-4  # learning rate 3e-3; measured gaps up to 3e-5 across ISAs after 2-5 steps
# CI's notebooks: its flags (check.sh's, compiled for speed of compiling) and 8 fake devices; the other one: XLA's
# default code generation, another ISA, another device count and one thread, as a user's machine computes
CONFIGS = {
    "ci": f"{XLA_BASE} --xla_force_host_platform_device_count=8".strip(),
    "other": ("--xla_force_host_platform_device_count=2 "
              "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
              + (" --xla_cpu_max_isa=SSE4_2" if platform.machine() in ("x86_64", "AMD64") else "")),
}


def close(a, b, what: str, rtol=RTOL, atol=0.0):
    "Assert `a` ≈ `b` within `rtol` of `b`'s largest entry (a scalar: of `b` itself) plus `atol`."
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=atol + rtol * float(np.abs(b).max(initial=0.0)), err_msg=what)


def pairs(results):
    "Each comparison the notebooks make between two programs: (name, a, b, rule)."
    for name in ("accumulation", "steps_per_call", "devices"):
        one, other = results[f"{name}_1"], results[f"{name}_n"]
        yield f"{name}: losses", one["losses"], other["losses"], {}
        if name != "steps_per_call":  # the first step's norm at the initial parameters (K steps: the last one's)
            yield f"{name}: gradient norm", one["grad_norm"], other["grad_norm"], {"rtol": NORM_RTOL}
        for i, (x, y) in enumerate(zip(one["params"], other["params"])):
            yield f"{name}: parameter {i}", y, x, {"rtol": 0.0, "atol": ADAM_ATOL}
    yield "chunked: loss", results["chunked_1"]["loss"], results["chunked_n"]["loss"], {}
    for i, (x, y) in enumerate(zip(results["chunked_1"]["grads"], results["chunked_n"]["grads"])):
        yield f"chunked: gradient {i}", y, x, {}


def load(path: Path) -> dict:
    "The worker's results: {case: {field: array or list of arrays}}."
    flat, out = np.load(path), {}
    for key in flat.files:
        case, field, *index = key.split("/")
        slot = out.setdefault(case, {})
        if index:
            slot.setdefault(field, []).append(flat[key])
        else:
            slot[field] = flat[key]
    return out


def test_float_checks_hold_under_another_isa(tmp_path):
    env = {**os.environ, **JAX_CACHE, "JAX_PLATFORMS": "cpu"}
    procs = {name: subprocess.Popen([sys.executable, __file__, str(tmp_path / f"{name}.npz")], text=True,
                                    env={**env, "XLA_FLAGS": flags}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, flags in CONFIGS.items()}
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}: {err[-3000:]}"
    results = {name: load(tmp_path / f"{name}.npz") for name in CONFIGS}
    for config, r in results.items():
        for what, a, b, rule in pairs(r):
            close(a, b, f"{config}, {what}", **rule)
    # the same program under the two configurations: what another machine may return, within the same budget
    for (what, a, _, rule), (_, c, _, _) in zip(pairs(results["ci"]), pairs(results["other"])):
        close(c, a, f"across configurations, {what}", **rule)


# ---- the worker: run in a fresh process so that XLA_FLAGS applies ----

def worker_setup():
    "04c_train's model, its configs and 2 batches of 8 windows (random tokens: summation order matters here, not text)."
    from tiny_lm.model import ModelConfig
    from tiny_lm.train import TrainConfig
    mcfg = ModelConfig(vocab_size=512, seq_len=64, d_model=64, n_layer=2, n_head=4)  # 04c_train's model: as cheap here
    tokens = np.random.default_rng(0).integers(0, 512, (2, 8, 65)).astype(np.int32)
    return mcfg, TrainConfig(warmup_steps=0), tokens


def run_steps(mcfg, tcfg, tokens, accum=1, K=1, mesh=None):
    "Losses, the first call's gradient norm and parameters after 2 optimizer steps (`K` a call, `accum` micro-batches)."
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tiny_lm.parallel import batch_put, sharded_init
    from tiny_lm.train import init_model, make_train_step
    create = lambda: init_model(mcfg, tcfg, total_steps=10)
    model, optimizer = create() if mesh is None else sharded_init(create, mesh)
    put = jnp.asarray if mesh is None else batch_put(mesh)
    step, state = make_train_step(model, optimizer, accum_steps=accum, steps_per_call=K)
    losses, norms = [], []
    for i in range(0, len(tokens), K):
        batch = put(tokens[i]) if K == 1 else tuple(put(t) for t in tokens[i:i + K])
        state, metrics = step(state, batch)
        losses += [float(metrics["loss"])] if K == 1 else [float(x) for x in metrics["losses"]]
        norms.append(float(metrics["grad_norm"]))
    nnx.update((model, optimizer), state)
    params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    return {"losses": np.array(losses), "grad_norm": np.array(norms[0]), "params": params}


def chunked_vs_plain(mcfg, tcfg, tokens):
    "The loss and gradients of the first batch, plain and chunked (slices of 5 time steps: 13 slices, 1 padded)."
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tiny_lm.loss import chunked_cross_entropy, loss_fn
    from tiny_lm.train import init_model
    model, _ = init_model(mcfg, tcfg, total_steps=1)
    batch = jnp.asarray(tokens[0])
    plain = lambda m: loss_fn(m, batch, chunked=False)
    sliced = lambda m: chunked_cross_entropy(m.logits, m.features(batch[:, :-1]), batch[:, 1:], mcfg.vocab_size,
                                             chunk_bytes=4 * 8 * mcfg.vocab_size * 5)
    out = {}
    for name, f in (("chunked_1", plain), ("chunked_n", sliced)):
        loss, grads = nnx.jit(nnx.value_and_grad(f))(model)
        out[name] = {"loss": np.asarray(loss), "grads": [np.asarray(g) for g in jax.tree.leaves(grads)]}
    return out


def worker(out: str) -> None:
    "Compute every pair of `pairs` under this process's XLA configuration; save them flat to `out` (.npz)."
    import jax
    from tiny_lm.parallel import make_mesh
    mcfg, tcfg, tokens = worker_setup()
    plain = run_steps(mcfg, tcfg, tokens)  # one device, one micro-batch, one step a call: the reference of three pairs
    results = {"accumulation_1": plain, "accumulation_n": run_steps(mcfg, tcfg, tokens, 4),
               "steps_per_call_1": plain, "steps_per_call_n": run_steps(mcfg, tcfg, tokens, K=2),
               "devices_1": plain, "devices_n": run_steps(mcfg, tcfg, tokens, mesh=make_mesh(jax.device_count(), 1)),
               **chunked_vs_plain(mcfg, tcfg, tokens)}
    flat = {}
    for case, fields in results.items():
        for field, value in fields.items():
            if isinstance(value, list):
                flat.update({f"{case}/{field}/{i}": v for i, v in enumerate(value)})
            else:
                flat[f"{case}/{field}"] = value
    np.savez(out, **flat)


if __name__ == "__main__":
    worker(sys.argv[1])
