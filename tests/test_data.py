"""tiny_lm.data end to end: exact resume of the stream (real encoder threads) and of the cached batches, the memory
bound on a multi-gigabyte corpus, the multi-host split in two real `jax.distributed` processes, and corrupt gzip input.

Every corpus is generated in `tmp_path`; nothing reads the network or files outside the test's own folders.
Run with `pytest -s` to see the measured numbers of the memory test.
"""
import faulthandler
import gzip
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from test_cli import JAX_CACHE, xla_flags  # the CLI tests' compilation cache (check.sh's, for the whole run)
from tiny_lm.data import DataConfig, open_source
from tiny_lm.batches import Batches, StreamingBatches, load_tokens
from tiny_lm.errors import TinyLMError
from tiny_lm.tokenizer import TokenizerConfig, train_tokenizer

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "da", "qu", "xi", "zo", "ba", "fe", "gu", "th", "er"]


# ----------------------------------------------------------------------------------------------------- fixtures
def make_docs(n: int, seed: int = 0, words: tuple[int, int] = (10, 60), first_id: int = 0) -> list[str]:
    """`n` documents of pseudo-words, each unique (it starts with its own number); single newlines only."""
    rng = random.Random(seed)
    docs = []
    for i in range(first_id, first_id + n):
        parts = [f"Document {i}:"]
        for _ in range(rng.randint(*words)):
            w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
            parts.append(w + rng.choice(["", "", "", ",", ".", ".\n"]))
        docs.append(" ".join(parts).strip())
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_txt_gz(path: Path, docs: list[str]) -> Path:
    path.write_bytes(gzip.compress("\n\n".join(docs).encode() + b"\n\n"))
    return path


def write_parquet_folder(folder: Path, docs: list[str], files: int = 3, row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir()
    per = -(-len(docs) // files)
    for f in range(files):
        part = docs[f * per:(f + 1) * per]
        table = pa.table({"text": part, "id": list(range(f * per, f * per + len(part)))})
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=row_group_size)
    return folder


WRITERS = {"jsonl": lambda tmp, docs: write_jsonl(tmp / "corpus.jsonl", docs),
           "txt.gz": lambda tmp, docs: write_txt_gz(tmp / "corpus.txt.gz", docs),
           "parquet": lambda tmp, docs: write_parquet_folder(tmp / "corpus_parquet", docs)}


@pytest.fixture(scope="module")
def tokenizer():
    """A 384-token byte-level BPE learned from ~200 KB of generated documents."""
    return train_tokenizer(make_docs(800, seed=99), TokenizerConfig(vocab_size=384))


def checkpoint_roundtrip(state: dict, folder: Path) -> dict:
    """Save a stream state as a checkpoint would (JSON for the plain values, .npz for the arrays) and load it back."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    assert set(arrays) == {"rest", "buffer"}
    (folder / "data_state.json").write_text(json.dumps({k: v for k, v in state.items() if k not in arrays}))
    np.savez(folder / "data_state.npz", **arrays)
    loaded = json.loads((folder / "data_state.json").read_text())
    with np.load(folder / "data_state.npz") as z:
        loaded.update({k: z[k] for k in z.files})
    return loaded


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: int):
    """Raise `Hang` if the block runs longer than `seconds` (SIGALRM, main thread)."""
    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


CLOSE_HANG = ("StreamingBatches.close() did not return within 60 s: it closes the stream's generator, whose encoder threads "
              "stop without waiting; a hang there is a data.py or encoding.py bug")


def close(stream) -> None:
    """`stream.close()`, failing with an explanation instead of hanging forever if it deadlocks."""
    try:
        with deadline(60):
            stream.close()
    except Hang:
        faulthandler.dump_traceback(all_threads=True)  # where the stream's threads are stuck
        pytest.fail(CLOSE_HANG)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------- 1. streaming resume
SEQ, B, BUF = 32, 4, 64


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_stream_resumes_exactly(tmp_path, tokenizer, fmt):
    """Snapshots of a stream fed by 2 encoder threads resume to the identical next 5 batches with 1 or 0 threads,
    straight from `snapshot()()` and after a JSON + .npz checkpoint round trip: inside the first buffer fill, after
    several buffers, and around the epoch boundary."""
    src = open_source(DataConfig(dataset_id=str(WRITERS[fmt](tmp_path, make_docs(240, seed=1)))))
    sb = StreamingBatches(src, tokenizer, SEQ, B, seed=7, buffer_size=BUF, num_workers=2)
    full, snaps, epochs = [], [], []
    try:
        while len(epochs) < 2000 and not (epochs and epochs[-1] == 1 and len(full) >= epochs.index(1) + 10):
            full.append(next(sb))
            snaps.append(sb.snapshot())  # taken after every batch, as training does
            epochs.append(snaps[-1]()["position"]["epoch"])
    finally:
        close(sb)
    assert 1 in epochs, "the corpus is too big: the stream never reached its second epoch"
    k_epoch = epochs.index(1) + 1  # batches done when the reader has first moved into epoch 1
    ks = {"first buffer fill": 2, "after 3 buffers": 3 * BUF // B + 2,
          "last batch of epoch 0": k_epoch - 1, "first batch of epoch 1": k_epoch, "inside epoch 1": k_epoch + 3}
    assert ks["first buffer fill"] * B < BUF < 3 * BUF < ks["after 3 buffers"] * B < ks["last batch of epoch 0"] * B
    for name, k in ks.items():
        state = snaps[k - 1]()
        assert state["batches"] == k and state["position"]["epoch"] == (0 if k < k_epoch else 1)
        saved = checkpoint_roundtrip(state, tmp_path / f"ckpt-{k}")
        for workers, st, how in [(1, state, "snapshot"), (0, state, "snapshot"), (0, saved, "checkpoint"), (1, saved, "checkpoint")]:
            if workers == 1 and how == "checkpoint" and k != k_epoch:
                continue  # once per corpus is enough for this combination
            if how == "checkpoint" and workers == 1:  # as the CLI resumes: build the stream, then load the state
                again = StreamingBatches(src, tokenizer, SEQ, B, seed=7, buffer_size=BUF, num_workers=workers)
                again.load_state(st)
            else:
                again = StreamingBatches(src, tokenizer, SEQ, B, seed=7, buffer_size=BUF, num_workers=workers, state=st)
            try:
                assert again.batches_done == k
                for j in range(5):
                    np.testing.assert_array_equal(next(again), full[k + j], err_msg=f"{fmt}, {name} (k={k}), {workers} threads, from {how}: batch {k + j}")
            finally:
                close(again)


def test_stream_state_rejects_other_settings(tmp_path, tokenizer):
    src = open_source(DataConfig(dataset_id=str(write_jsonl(tmp_path / "c.jsonl", make_docs(100)))))
    sb = StreamingBatches(src, tokenizer, SEQ, B, buffer_size=BUF, num_workers=0)
    next(sb)
    state = sb.state()
    with pytest.raises(TinyLMError, match="seq_len: saved 32, now 16"):
        StreamingBatches(src, tokenizer, 16, B, buffer_size=BUF, num_workers=0, state=state)
    with pytest.raises(TinyLMError, match="--no-streaming"):
        StreamingBatches(src, tokenizer, SEQ, B, buffer_size=BUF, num_workers=0, state={"kind": "cached"})


def test_state_before_the_first_batch(tmp_path, tokenizer):
    """A stream that has drawn no batch yet (e.g. a checkpoint at step 0) should have a state that resumes at batch 0."""
    src = open_source(DataConfig(dataset_id=str(write_jsonl(tmp_path / "c.jsonl", make_docs(100)))))
    fresh = StreamingBatches(src, tokenizer, SEQ, B, buffer_size=BUF, num_workers=0)
    state = fresh.state()
    again = StreamingBatches(src, tokenizer, SEQ, B, buffer_size=BUF, num_workers=0, state=state)
    np.testing.assert_array_equal(next(again), next(fresh))


# -------------------------------------------------------------------------------------------- 2. cached resume
def test_cached_tokens_and_batches_resume_exactly(tmp_path, tokenizer):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_docs(600, seed=2))
    cfg = DataConfig(dataset_id=str(corpus), streaming=False)
    src = open_source(cfg)
    in_memory = load_tokens(src, "train", tokenizer, cache_dir=None, num_workers=0)
    cache = tmp_path / "cache"
    tokens = load_tokens(src, "train", tokenizer, cache_dir=cache, num_workers=2)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, in_memory)
    serial = load_tokens(src, "train", tokenizer, cache_dir=tmp_path / "cache0", num_workers=0)
    assert Path(serial.filename).read_bytes() == Path(tokens.filename).read_bytes()

    files = sorted(cache.iterdir())
    assert [p.name for p in files] == [Path(tokens.filename).name]  # no temporary file left behind
    mtime = files[0].stat().st_mtime_ns
    reopened = load_tokens(open_source(cfg), "train", tokenizer, cache_dir=cache, num_workers=2)  # a new run
    assert isinstance(reopened, np.memmap) and reopened.filename == tokens.filename
    assert files[0].stat().st_mtime_ns == mtime and sorted(cache.iterdir()) == files

    first = Batches(tokens, SEQ, 8, seed=3)
    again = Batches(reopened, SEQ, 8, seed=3)
    steps = [0, 1, 17, int(first.steps_per_epoch), int(first.steps_per_epoch) + 1, int(3.5 * first.steps_per_epoch)]
    assert first.steps_per_epoch > 2
    for i in reversed(steps):  # any order: a pure function of the step
        b = again[i]
        assert b.shape == (8, SEQ + 1) and b.dtype == np.int32
        np.testing.assert_array_equal(b, first[i])

    val = load_tokens(src, "val", tokenizer, cache_dir=cache, num_workers=2)
    assert isinstance(val, np.memmap) and 0 < len(val) < len(tokens) // 10
    np.testing.assert_array_equal(val, load_tokens(src, "val", tokenizer, num_workers=0))


# ------------------------------------------------------------------------------------------- 3. memory bound
MEMORY_SCRIPT = '''
import faulthandler, json, resource, sys, time
from itertools import islice

def peak_rss_mb():
    """This process's peak RSS. Not ru_maxrss: Linux keeps it across exec, so it would report the peak of the
    process that started us (a pytest worker that imported torch measures 640 MB here)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def main():
    faulthandler.dump_traceback_later(100, exit=True)  # a hang (e.g. in close) ends the run with its traceback
    t0 = time.perf_counter()
    from tiny_lm.data import DataConfig, open_source
    from tiny_lm.batches import StreamingBatches
    from tiny_lm.tokenizer import TokenizerConfig, train_tokenizer
    spec = json.loads(sys.argv[1])
    t_import = time.perf_counter()
    src = open_source(DataConfig(dataset_id=spec["path"], streaming=True))
    tok = train_tokenizer(islice(src.documents("train"), 2000), TokenizerConfig(vocab_size=512))
    t_tok = time.perf_counter()
    kw = dict(seq_len=64, batch_size=8, seed=0, buffer_size=1000, num_workers=2)
    sb = StreamingBatches(src, tok, **kw)
    next(sb)
    t_first = time.perf_counter()
    for _ in range(199):
        next(sb)
    t_200 = time.perf_counter()
    state = sb.state()
    sb.close()
    # jump near the end of the file: a line start, with its row number
    state["position"] = {"epoch": 0, "shard": 0, "pos": spec["late_pos"], "row": spec["late_row"], "docs": spec["late_row"]}
    late = StreamingBatches(src, tok, **kw, state=state)
    wrapped = None
    for n in range(1, 5001):
        next(late)
        if wrapped is None and late.snapshot()()["position"]["epoch"] == 1:
            wrapped = n
        if wrapped is not None and n >= wrapped + 50:
            break
    after = late.state()["position"]
    late.close()
    t_end = time.perf_counter()
    print(json.dumps({
        "import_s": t_import - t0, "open_and_tokenizer_s": t_tok - t_import, "first_batch_s": t_first - t_tok,
        "time_to_first_batch_s": t_first - t_import, "200_batches_s": t_200 - t_first, "wrap_s": t_end - t_200,
        "batches_to_wrap": wrapped, "after_wrap": after,
        "main_peak_rss_mb": peak_rss_mb()}))

if __name__ == "__main__":
    main()
'''


def write_repeated_jsonl(path: Path, target_bytes: int) -> dict:
    """A .jsonl of ~`target_bytes`: a ~1 MiB block of varied lines written over and over (fast: the disk is the limit).
    Returns where a line ~150 lines before the end starts (byte offset and row number)."""
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in make_docs(2600, seed=5, words=(30, 90))]
    block = b"".join(lines)
    reps = max(1, target_bytes // len(block))
    with open(path, "wb", buffering=0) as f:
        f.writelines(block for _ in range(reps))
    j = len(lines) - 150
    return {"path": str(path), "bytes": reps * len(block), "late_pos": (reps - 1) * len(block) + sum(map(len, lines[:j])),
            "late_row": (reps - 1) * len(lines) + j}


def run_memory_script(script: Path, spec: dict) -> dict:
    r = subprocess.run([sys.executable, str(script), json.dumps(spec)], check=False, capture_output=True, text=True, env=ENV, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_memory_is_bounded_on_a_2gib_corpus(tmp_path):
    """Streaming a 2 GiB .jsonl costs no more memory than a 20 MiB one.

    In a subprocess (2 encoder threads): open the source, train a 512-token tokenizer on 2000 documents,
    draw the first batch (time-to-first-batch < 20 s), 200 batches, then restore a state pointing ~150 lines before
    the end of the file and stream across the epoch wrap back to the beginning.
    Bounds: peak RSS of the 2 GiB run within +100 MB of the 20 MiB run, and below 600 MB in absolute terms (the
    process does all the work: its encoder threads are inside it). Measured on the dev box (2 cores) with worker
    processes before: 159 MB main and 50 MB per worker for both sizes, time to first batch 0.6 s.
    """
    if shutil.disk_usage(tmp_path).free < 6e9:
        pytest.skip(f"needs 6 GB free in {tmp_path} for the 2 GiB corpus, has {shutil.disk_usage(tmp_path).free / 1e9:.1f} GB")
    script = tmp_path / "stream_memory.py"
    script.write_text(MEMORY_SCRIPT)
    results = {}
    for name, size in [("20 MiB", 20 << 20), ("2 GiB", 2 << 30)]:
        path = tmp_path / f"corpus-{name.replace(' ', '')}.jsonl"
        t = time.perf_counter()
        spec = write_repeated_jsonl(path, size)
        written = time.perf_counter() - t
        try:
            results[name] = res = run_memory_script(script, spec)
        finally:
            path.unlink()  # pytest keeps the last runs' tmp folders: do not leave 2 GiB behind
        print(f"\n[memory] {name} corpus ({spec['bytes'] / 2**20:.0f} MiB, written in {written:.1f} s): "
              f"import {res['import_s']:.2f} s, then time to first batch {res['time_to_first_batch_s']:.2f} s (open + tokenizer {res['open_and_tokenizer_s']:.2f} s, "
              f"first batch {res['first_batch_s']:.2f} s), 200 batches {res['200_batches_s']:.2f} s, "
              f"wrap after {res['batches_to_wrap']} batches ({res['wrap_s']:.2f} s); peak RSS {res['main_peak_rss_mb']:.0f} MB")
        assert res["time_to_first_batch_s"] < 20
        assert res["batches_to_wrap"] is not None, "the stream never wrapped to epoch 1"
        assert res["after_wrap"]["epoch"] == 1 and res["after_wrap"]["row"] < 5000, res["after_wrap"]  # back at the start
    small, big = results["20 MiB"], results["2 GiB"]
    assert big["main_peak_rss_mb"] < small["main_peak_rss_mb"] + 100
    assert big["main_peak_rss_mb"] < 600


# --------------------------------------------------------------------------------------- 4. two-process share
MULTIHOST_SCRIPT = '''
import json, sys
from pathlib import Path

def main():
    pid, port, spec = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from tokenizers import Tokenizer
    from tiny_lm.data import DataConfig, open_source
    from tiny_lm.batches import Batches, StreamingBatches, load_tokens
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=50)
    me, count = jax.process_index(), jax.process_count()
    assert (me, count, jax.local_device_count(), jax.device_count()) == (pid, 2, 4, 8)
    tok = Tokenizer.from_file(spec["tokenizer"])
    src = open_source(DataConfig(dataset_id=spec["corpus"]))
    sb = StreamingBatches(src, tok, spec["seq_len"], spec["batch"], seed=0, buffer_size=32, num_workers=0,
                          process_index=me, process_count=count)
    stream = np.stack([next(sb) for _ in range(spec["steps"])])
    sb.close()
    multihost_utils.sync_global_devices("cache")  # both write the same cache file: tmp + rename
    tokens = load_tokens(src, "train", tok, cache_dir=spec["cache"], num_workers=0)
    cached = Batches(tokens, spec["seq_len"], spec["batch"], seed=0, process_index=me, process_count=count)
    batches = np.stack([cached[i] for i in range(spec["steps"])])
    gathered = multihost_utils.process_allgather(batches[0])  # [2, B, T]: every process sees both shares
    out = Path(spec["out"])
    np.save(out / f"stream{me}.npy", stream)
    np.save(out / f"cached{me}.npy", batches)
    np.save(out / f"gathered{me}.npy", gathered)
    multihost_utils.sync_global_devices("done")

if __name__ == "__main__":
    main()
'''


def test_two_processes_share_the_data(tmp_path, tokenizer):
    """Two `jax.distributed` CPU processes (4 devices each): disjoint streaming windows, and cached batches that
    concatenate to the single-process batch of twice the size."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_docs(400, seed=3))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "out").mkdir()
    spec = {"corpus": str(corpus), "tokenizer": str(tmp_path / "tokenizer.json"), "cache": str(tmp_path / "cache"),
            "out": str(tmp_path / "out"), "seq_len": SEQ, "batch": B, "steps": 20}
    script = tmp_path / "multihost.py"
    script.write_text(MULTIHOST_SCRIPT)
    env = {**ENV, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(4)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), json.dumps(spec)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    started, outputs = time.monotonic(), []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, 60 - (time.monotonic() - started))))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - started
    print(f"\n[multihost] both processes done in {elapsed:.1f} s")
    for i, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"
    out = tmp_path / "out"
    stream = [np.load(out / f"stream{i}.npy") for i in range(2)]
    cached = [np.load(out / f"cached{i}.npy") for i in range(2)]
    assert stream[0].shape == cached[0].shape == (20, B, SEQ + 1)

    windows = [{w.tobytes() for w in s.reshape(-1, SEQ + 1)} for s in stream]
    assert len(windows[0]) > 70 and len(windows[1]) > 70  # the corpus's windows are unique
    assert not windows[0] & windows[1], "the two processes streamed the same windows"

    src = open_source(DataConfig(dataset_id=str(corpus)))
    whole = Batches(load_tokens(src, "train", tokenizer, cache_dir=tmp_path / "cache"), SEQ, 2 * B, seed=0)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    for i in range(20):
        np.testing.assert_array_equal(np.concatenate([cached[0][i], cached[1][i]]), whole[i], err_msg=f"batch {i}")
    for i in range(2):
        np.testing.assert_array_equal(np.load(out / f"gathered{i}.npy"), np.stack([cached[0][0], cached[1][0]]))


# ------------------------------------------------------------------------------------------- 5. corrupt gzip
def write_corrupt_gzip(path: Path, kind: str) -> Path:
    """A .txt.gz of ~4 MB of text whose beginning reads fine (so `open_source` accepts it) but which breaks later."""
    text = "\n\n".join(make_docs(300, seed=4, words=(60, 120))).encode()
    text = b"\n\n".join([text] * 24)  # ~4 MB decompressed: the damage lies well past the first MB that open_source reads
    good = gzip.compress(text, compresslevel=1, mtime=0)
    if kind == "garbage after the first member":
        data = good + random.Random(0).randbytes(50_000)
    elif kind == "corrupt deflate data":
        b = bytearray(good)
        at = len(b) * 3 // 4
        b[at:at + 4000] = random.Random(1).randbytes(4000)
        data = bytes(b)
    else:  # truncated
        data = good[: len(good) * 3 // 4]
    path.write_bytes(data)
    return path


GZIP_DAMAGE = ["garbage after the first member", "corrupt deflate data", "truncated"]


def stream_everything(src, tokenizer, workers: int):
    sb = StreamingBatches(src, tokenizer, SEQ, 64, buffer_size=BUF, num_workers=workers)
    try:
        for _ in range(100_000):
            next(sb)
    finally:
        close(sb)


@pytest.mark.parametrize("damage", GZIP_DAMAGE)
def test_corrupt_gzip_fails_fast(tmp_path, tokenizer, damage):
    """Streaming a gzip that is damaged deep inside stops with an error, with or without encoder threads, and never hangs."""
    path = write_corrupt_gzip(tmp_path / "damaged.txt.gz", damage)
    src = open_source(DataConfig(dataset_id=str(path)))  # the damage is past what open_source reads
    for workers in (0, 2):
        started = time.perf_counter()
        with deadline(60), pytest.raises(Exception) as e:
            stream_everything(src, tokenizer, workers)
        assert not isinstance(e.value, Hang)
        print(f"\n[gzip] {damage}, {workers} threads: {type(e.value).__name__} after {time.perf_counter() - started:.1f} s: {e.value}")
        assert isinstance(e.value, TinyLMError), repr(e.value)


@pytest.mark.parametrize("damage", GZIP_DAMAGE)
def test_corrupt_gzip_error_names_the_file(tmp_path, tokenizer, damage):
    path = write_corrupt_gzip(tmp_path / "damaged.txt.gz", damage)
    src = open_source(DataConfig(dataset_id=str(path)))
    with deadline(60), pytest.raises(TinyLMError, match="damaged.txt.gz"):
        stream_everything(src, tokenizer, 0)
    with deadline(60), pytest.raises(TinyLMError, match="damaged.txt.gz"):
        load_tokens(src, "train", tokenizer, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------- small sources: a validation split, always
def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs))
    return path


@pytest.mark.parametrize("n,fmt,val_split", [(60, "jsonl", "auto"), (5, "jsonl", "auto"), (1, "jsonl", "auto"),
                                             (5, "txt", "auto"), (60, "txt", "0.1"), (1, "txt", "0.1")])
def test_small_source_holds_out_validation(tmp_path, n, fmt, val_split):
    """60, 5 or 1 long documents: validation is not empty, shares no text with training, the two make the source,
    a second opening splits alike, and the description gives the real share (the 2 % hash alone picks none of 60).
    A .txt file is one text: its last paragraphs validate, contiguous, however few there are."""
    docs = make_docs(n, words=(300, 400))
    path = (write_jsonl if fmt == "jsonl" else write_txt)(tmp_path / f"small.{fmt}", docs)
    src = open_source(DataConfig(str(path), val_split=val_split, num_workers=0))
    train, val = list(src.documents("train")), list(src.documents("val"))
    assert train and val
    if n == 1:
        assert train[0] + val[0] == docs[0] and train[0][-1] in " \n"  # cut at a line or word boundary
        share, fraction = len(val[0]) / len(docs[0]), 0.02 if val_split == "auto" else float(val_split)
        assert fraction <= share < 2 * fraction  # moved back to a boundary: at most twice the share asked for
        assert f"the last {share * 100:.1f}".rstrip("0").rstrip(".") in src.val_description
    elif fmt == "txt":
        k = len(train)
        assert (train, val) == (docs[:k], docs[k:])  # the head trains, the tail validates
        assert f"(paragraphs {k + 1:,}–{n:,} of {n:,}, contiguous" in src.val_description
    else:
        assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
        assert f"{len(val)} of {n} documents" in src.val_description and src.val_description in repr(src)
    again = open_source(DataConfig(str(path), val_split=val_split, num_workers=0))
    assert (list(again.documents("train")), list(again.documents("val"))) == (train, val)


def test_small_source_token_cache_follows_its_split(tmp_path, tokenizer):
    """A cache written under the plain hash rule (all 5 documents train) is not reused for the small-source rule."""
    from tiny_lm.data import HoldOut
    from tiny_lm.encoding import tokenize_documents
    path = write_jsonl(tmp_path / "five.jsonl", make_docs(5))
    old = open_source(DataConfig(str(path)))
    old.hold_out = HoldOut(old.val_fraction)  # the rule of earlier versions: the hash alone
    assert len(list(old.documents("train"))) == 5
    load_tokens(old, "train", tokenizer, tmp_path / "cache")
    src = open_source(DataConfig(str(path)))
    tokens = load_tokens(src, "train", tokenizer, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-train-*"))) == 2
    assert np.array_equal(tokens, tokenize_documents(list(src.documents("train")), tokenizer, src.separator))


def test_text_file_token_cache_follows_its_tail(tmp_path, tokenizer):
    """A cache written under the hash rule that earlier versions applied to one .txt file is not reused for its tail."""
    from tiny_lm.data import HoldOut
    from tiny_lm.encoding import tokenize_documents
    path = write_txt(tmp_path / "play.txt", make_docs(300))
    old = open_source(DataConfig(str(path)))
    old.hold_out = HoldOut(old.val_fraction)  # the rule of earlier versions: the hash alone
    load_tokens(old, "train", tokenizer, tmp_path / "cache")
    src = open_source(DataConfig(str(path)))
    assert list(old.documents("train")) != list(src.documents("train"))
    tokens = load_tokens(src, "train", tokenizer, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-train-*"))) == 2
    assert np.array_equal(tokens, tokenize_documents(list(src.documents("train")), tokenizer, src.separator))


def test_text_file_tail_streams_and_resumes(tmp_path, tokenizer):
    """One .txt file streams only its head for training, and resumes from a state taken mid-file exactly; the
    validation windows are the tail's, from the cut on."""
    from tiny_lm.batches import first_tokens
    from tiny_lm.encoding import tokenize_documents
    docs = make_docs(400, seed=6)
    src = open_source(DataConfig(str(write_txt(tmp_path / "play.txt", docs)), val_split="0.1"))
    k = src.hold_out.documents - src.hold_out.held
    assert (list(src.documents("train")), list(src.documents("val"))) == (docs[:k], docs[k:])
    assert np.array_equal(first_tokens(src, "val", tokenizer, 10**9), tokenize_documents(docs[k:], tokenizer, "\n\n"))
    run = StreamingBatches(src, tokenizer, SEQ, B, buffer_size=8, num_workers=0)
    states, batches = [], []
    for _ in range(30):
        batches.append(next(run))
        states.append(checkpoint_roundtrip(run.state(), tmp_path / f"s{len(states)}"))
    close(run)
    assert 0 < states[10]["position"]["pos"] < src.hold_out.cut[0]  # mid-file, in the head
    again = StreamingBatches(src, tokenizer, SEQ, B, buffer_size=8, num_workers=0, state=states[10])
    assert all(np.array_equal(next(again), b) for b in batches[11:])
    close(again)


class ListStream:
    """Rows as a hub stream gives them (`state_dict`, `load_state_dict`, iteration), without `datasets`."""
    def __init__(self, texts: list[str]):
        self.rows = [{"text": t} for t in texts]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def __iter__(self):
        return iter(self.rows)


def test_no_text_errors_say_which_case(tmp_path):
    """A source with no text, one document too short to cut, or a hub stream too short for the hash: one line each."""
    from tiny_lm.data import Shard, TextSource
    blank = write_jsonl(tmp_path / "blank.jsonl", [" ", ""])
    with pytest.raises(TinyLMError, match="'train' split of .* holds no text in column 'text' .every row is empty"):
        list(open_source(DataConfig(str(blank))).documents("val"))
    with pytest.raises(TinyLMError, match="only document is too short"):
        list(open_source(DataConfig(str(write_txt(tmp_path / "x.txt", ["x"])))).documents("val"))
    hub = TextSource(DataConfig("owner/name"), {"train": [Shard("hub", stream=ListStream(make_docs(5)), start={})]},
                     "", {}, None)
    assert len(list(hub.documents("train"))) == 5  # a stream is not read ahead: the hash alone decides
    with pytest.raises(TinyLMError, match=r"validation hold-out of owner/name \(2 % of the rows.* --val-split"):
        list(hub.documents("val"))


def test_small_source_stream_resumes_exactly(tmp_path, tokenizer):
    """A single document split into head and tail streams its head only, and resumes from any state exactly."""
    src = open_source(DataConfig(str(write_txt(tmp_path / "one.txt", make_docs(1, words=(3000, 3000))))))
    head = list(src.documents("train"))[0]
    assert list(src.documents("val")) and make_docs(1, words=(3000, 3000))[0].startswith(head)
    run = StreamingBatches(src, tokenizer, SEQ, 2, buffer_size=8, num_workers=0)
    states, batches = [], []
    for _ in range(12):
        batches.append(next(run))
        states.append(checkpoint_roundtrip(run.state(), tmp_path / f"s{len(states)}"))
    close(run)
    again = StreamingBatches(src, tokenizer, SEQ, 2, buffer_size=8, num_workers=0, state=states[4])
    assert all(np.array_equal(next(again), b) for b in batches[5:])
    close(again)


TRAIN_SMALL = """
import json, sys
from tiny_lm.data import DataConfig
from tiny_lm.model import ModelConfig
from tiny_lm.run import Trainer
from tiny_lm.tokenizer import TokenizerConfig
from tiny_lm.train import TrainConfig
model = lambda V: ModelConfig(vocab_size=V, seq_len=32, d_model=32, n_layer=1, n_head=2)
steps = TrainConfig(batch_size=2, max_steps=2, eval_every=2, save_every=2, warmup_steps=1, eval_batches=2)
for path in sys.argv[1:]:
    summary = Trainer(model, steps, DataConfig(path, num_workers=0), path + ".run", TokenizerConfig(vocab_size=300),
                      progress=False, sample_tokens=0).fit()  # no sample: the summary is what is checked
    print("SUMMARY", json.dumps(summary))
"""


def test_small_sources_train_with_a_validation_loss(tmp_path):
    """60 and 5 documents (jsonl) and a single one (txt) each train a tiny model and report a finite validation loss."""
    paths = [write_jsonl(tmp_path / "sixty.jsonl", make_docs(60, words=(300, 400))),
             write_jsonl(tmp_path / "five.jsonl", make_docs(5, words=(300, 400))),
             write_txt(tmp_path / "one.txt", make_docs(1, words=(3000, 3000)))]
    r = subprocess.run([sys.executable, "-c", TRAIN_SMALL, *map(str, paths)], capture_output=True, text=True,
                       env={**ENV, "XLA_FLAGS": xla_flags(1), **JAX_CACHE}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summaries) == 3 and all(np.isfinite(s["final_val_loss"]) for s in summaries)
    for held in ["1 of 60 documents (1.7 %) held out", "1 of 5 documents (20 %) held out",
                 "of the single document held out"]:
        assert held in r.stdout, r.stdout[-3000:]
