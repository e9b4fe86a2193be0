"""One process of a multi-process tiny_lm run (tests/test_multihost.py starts two of them, or one alone).

Usage: python multihost_worker.py OUT.json [COORDINATOR NUM_PROCESSES PROCESS_ID [--prepare TEXT_FILE RUN_DIR]]
Trains a tiny model for a few steps on random tokens over a data × fsdp mesh of every device of
every process, feeding only this process's rows, and writes its losses, the windows it read and a
checksum of the final parameters to OUT.json.
With --prepare, it only prepares a run's tokenizer and cached data from TEXT_FILE, twice: in RUN_DIR/shared
(one folder for every process) and in RUN_DIR/pN (a folder of its own, as on hosts with separate disks),
and writes what each preparation said to OUT.json, with the CPU speed the process plans by where each process's
measurement gave another.
"""
import json
import sys
from pathlib import Path


def planned_cpu_speed(cache_home: Path) -> float:
    "The CPU speed this process plans by, its cache holding a figure of its own (process i: i + 1 GFLOP/s)."
    import os

    import jax

    from tiny_lm.cpu_speed import cpu_speed_key
    from tiny_lm.profiles import plan_speed
    from tiny_lm.sizing import measured_once

    os.environ["XDG_CACHE_HOME"] = str(cache_home)
    measured_once("cpu_train_flops", cpu_speed_key(), lambda: (jax.process_index() + 1) * 1e9)
    return plan_speed(None).flops


def prepare(out, text_file, run_dir):
    "The tokenizer and the token cache of a run, as `Trainer` prepares them, in a shared folder and in a private one."
    import jax

    from tiny_lm.data import DataConfig, open_source
    from tiny_lm.prepare import prepare_data, prepare_tokenizer
    from tiny_lm.tokenizer import TokenizerConfig, tokenizer_fingerprint
    from tiny_lm.train import TrainConfig

    data_cfg = DataConfig(text_file, streaming=False, num_workers=0)
    source, report = open_source(data_cfg), {"speed": planned_cpu_speed(Path(run_dir) / f"cache{jax.process_index()}")}
    for case, folder in [("shared", Path(run_dir) / "shared"), ("own", Path(run_dir) / f"p{jax.process_index()}")]:
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer, how = prepare_tokenizer(source, TokenizerConfig(vocab_size=300), folder, None, False, None,
                                           say=lambda *a: None)
        data = prepare_data(source, tokenizer, data_cfg, 32, TrainConfig(batch_size=1, eval_batches=1), folder, 3.0)
        report[case] = {"how": how, "fingerprint": tokenizer_fingerprint(tokenizer), "data": data.description,
                        "tokens": int(data.batches.tokens.sum()), "files": sorted(p.name for p in folder.rglob("*"))}
    json.dump(report, open(out, "w"))


if __name__ == "__main__":
    out, *dist = sys.argv[1:]
    from tiny_lm.parallel import batch_put, initialize_distributed, make_mesh, sharded_init

    if dist:
        initialize_distributed(dist[0], int(dist[1]), int(dist[2]), timeout_s=60)
    if dist[3:4] == ["--prepare"]:
        prepare(out, *dist[4:6])
        sys.exit(0)
    import jax
    import numpy as np
    from flax import nnx

    from tiny_lm.batches import Batches
    from tiny_lm.model import ModelConfig
    from tiny_lm.train import TrainConfig, fit, init_model

    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2)
    train = TrainConfig(batch_size=1, max_steps=6, warmup_steps=2, log_every=1)
    tokens = np.random.default_rng(0).integers(0, 64, 5000).astype(np.uint16)
    local_rows = train.batch_size * jax.local_device_count()  # 1 per device: a global batch of 8
    batches = Batches(tokens, 16, local_rows, process_index=jax.process_index(), process_count=jax.process_count())
    mesh = make_mesh(2, jax.device_count() // 2)  # data=2 × fsdp=4: sharded parameters and a split batch
    model, optimizer = sharded_init(lambda: init_model(cfg, train, 6), mesh)
    run = fit(model, optimizer, batches, train, 6, put=batch_put(mesh), progress=False)
    params = nnx.state(model, nnx.Param)
    checksum = float(sum(float(jax.numpy.sum(jax.numpy.abs(x))) for x in jax.tree.leaves(params)))
    json.dump({"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
               "losses": [h["loss"] for h in run.history], "windows": [batches.window_starts(i).tolist() for i in range(6)],
               "checksum": checksum}, open(out, "w"))
