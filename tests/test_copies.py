"""Copies of a run elsewhere, end to end: a backup folder and real S3, GCS and Azure emulators on 127.0.0.1 (moto,
gcp-storage-emulator, azurite), started here. Save, kill -9, lose the machine, resume from the copy alone."""
import fcntl
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from test_cli import ENV, in_process, tiny_lm, without
from test_faults import RUN, final_params, losses, start, wait_until
from test_multihost import free_port

AZURITE = Path.home() / ".cache" / "tiny_lm_tests" / "azurite-3.35.0"  # azurite 3.35 is the last that runs on Node 20
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's published development key
BUCKET, PREFIX = "tiny-lm-runs", "shakespeare/run1"
# RUN with a checkpoint (so a copy) every 6 steps, not 3: half the saves and uploads. Still one step a call
# (--log-every 1), so each step's program is RUN's and the losses and parameters must equal `reference`'s, bit for bit.
COPY_RUN = [*without(RUN, "--save-every"), "--save-every", "6"]


def serve(cmd: list, port: int, log: Path, env=None) -> subprocess.Popen:
    """Start an emulator and wait until its port answers."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"{cmd[0]} exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{cmd[0]} did not start: {log.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)


def azurite_blob() -> str:
    """The azurite emulator's command, installed on first use: by one worker at a time (a lock), tried three times
    (on a fresh machine both workers' installs failed once, 2026-11-30, and `npm install` of the same package a few
    minutes later did not), the last failure's npm output in the error."""
    exe = AZURITE / "node_modules" / ".bin" / "azurite-blob"
    npm = shutil.which("npm")
    assert exe.exists() or npm, ("the Azure copy test needs Node.js and npm, to run the azurite emulator "
                                 "(npm install azurite@3.35.0)")
    AZURITE.parent.mkdir(parents=True, exist_ok=True)
    with open(AZURITE.with_name(f"{AZURITE.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait here, then find it installed
        for attempt in range(3):
            if exe.exists():
                break
            tmp = AZURITE.with_name(f"{AZURITE.name}.tmp-{os.getpid()}")  # installed aside, then renamed: never half
            shutil.rmtree(tmp, ignore_errors=True)
            r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(tmp), "azurite@3.35.0"],
                               timeout=600, capture_output=True, text=True)
            if r.returncode == 0:
                shutil.rmtree(AZURITE, ignore_errors=True)  # (a broken install of an older test run)
                tmp.rename(AZURITE)
            elif attempt < 2:
                time.sleep(5 * (attempt + 1))  # then again
        assert exe.exists(), f"npm install azurite@3.35.0 failed three times: {r.stderr[-2000:]}"
    return str(exe)


class Cloud:
    """One emulator: the environment and flags a run needs, and a file system on the bucket for the test to look with."""
    def __init__(self, provider: str, workdir: Path):
        self.provider, self.port, self.secret = provider, free_port(), None
        log = workdir / f"{provider}.log"
        if provider == "s3":
            import s3fs
            self.secret = "s3-secret-" + secrets.token_hex(8)
            self.proc = serve([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)], self.port, log)
            self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}
            self.fs = s3fs.S3FileSystem(endpoint_url=self.env["AWS_ENDPOINT_URL"], key="testing", secret=self.secret, skip_instance_cache=True)
            self.flags, self.scheme = ["--cloud-provider", "s3", "--cloud-region", "us-east-1"], "s3"
        elif provider == "gcs":
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # read when gcsfs is imported: the emulator has no gRPC
            import gcsfs
            # gcs_emulator.py: gcp-storage-emulator with a fix (a file ending in CR was stored one byte short)
            self.proc = serve([sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), "start", "--host", "127.0.0.1",
                               "--port", str(self.port), "--in-memory"], self.port, log)
            self.env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}"}  # tiny-lm turns gcsfs's gRPC off for an emulator
            self.fs = gcsfs.GCSFileSystem(endpoint_url=self.env["STORAGE_EMULATOR_HOST"], token="anon", skip_instance_cache=True)
            self.flags, self.scheme = ["--cloud-provider", "gcs"], "gs"
        else:
            import adlfs
            from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas
            self.proc = serve([azurite_blob(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
                               "--skipApiVersionCheck", "--loose", "--disableTelemetry"], self.port, log)
            endpoint = f"http://127.0.0.1:{self.port}/devstoreaccount1"
            self.secret = generate_account_sas("devstoreaccount1", DEV_KEY, ResourceTypes(service=True, container=True, object=True),
                                               AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
                                               expiry=datetime.now(timezone.utc) + timedelta(hours=2))
            # the endpoint only; the SAS token from the variable adlfs reads, not a flag (shell history, `ps`)
            self.env = {"AZURE_STORAGE_CONNECTION_STRING": f"BlobEndpoint={endpoint};", "AZURE_STORAGE_SAS_TOKEN": self.secret}
            self.fs = adlfs.AzureBlobFileSystem(connection_string=f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={DEV_KEY};BlobEndpoint={endpoint};",
                                                skip_instance_cache=True)
            self.flags, self.scheme = ["--cloud-provider", "azure", "--azure-account-name", "devstoreaccount1"], "az"
        self.fs.mkdir(BUCKET)
        self.flags += ["--cloud-bucket", BUCKET, "--cloud-prefix", PREFIX]
        self.url = f"{self.scheme}://{BUCKET}/{PREFIX}"
        self.env = {**ENV, **self.env}

    def complete_steps(self) -> list:
        time.sleep(0.1)  # polled in a loop: leave the emulator time for the run's own requests
        self.fs.invalidate_cache()
        markers = self.fs.glob(f"{BUCKET}/{PREFIX}/checkpoint_step_*/tiny_lm_complete.json")
        return sorted(int(m.split("/")[-2].rsplit("_", 1)[1]) for m in markers)

    def objects(self) -> dict:
        self.fs.invalidate_cache()
        return {p: self.fs.cat_file(p) for p in self.fs.find(f"{BUCKET}/{PREFIX}")}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def clouds(tmp_path_factory):
    """Emulators started on demand, one of each kind per test worker, stopped at the end."""
    started, workdir = {}, tmp_path_factory.mktemp("emulators")
    def get(provider: str) -> Cloud:
        if provider not in started:
            started[provider] = Cloud(provider, workdir)
        return started[provider]
    yield get
    for cloud in started.values():
        cloud.stop()


def folder_steps(path: Path) -> list:
    return sorted(int(p.parent.name.rsplit("_", 1)[1]) for p in path.glob("checkpoint_step_*/tiny_lm_complete.json"))


def written_text(*folders: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for f in folders if f.exists() for p in f.rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["folder", "s3", "gcs", "azure"])
def test_copy_kill_9_lose_the_machine_resume_from_the_copy(reference, clouds, tmp_path, where):
    """Train with copies; kill -9 once a copy of step 30 or later is complete (later copies may be cut short); delete the
    run folder; the same command with --resume-from the copy ends equal to an uninterrupted run, bit for bit."""
    if where == "folder":
        backup = tmp_path / "drive" / "run1"
        flags, env, url, copied = ["--backup-dir", str(backup)], ENV, str(backup), lambda: folder_steps(backup)
    else:
        cloud = clouds(where)
        flags, env, url, copied = cloud.flags, cloud.env, cloud.url, cloud.complete_steps
    out = tmp_path / "o"
    p = start(out, *COPY_RUN, *flags, env=env)
    wait_until(lambda: any(s >= 30 for s in copied()), p)
    p.kill()
    stdout, stderr = p.communicate()
    newest = max(copied())
    assert newest < 60
    texts = [stdout, stderr, written_text(out)]
    shutil.rmtree(out)  # the machine is gone: only the copy is left

    out2 = tmp_path / "o2"
    r = tiny_lm("train", *COPY_RUN, *flags, "--resume-from", url, "--output-dir", str(out2), env=env)
    assert r.returncode == 0, r.stderr
    assert f"at step {newest} of 60" in r.stdout, r.stdout
    assert where == "folder" or f"fetched checkpoint_step_{newest} of {url}" in r.stdout, r.stdout
    ref_losses, ref_params = reference
    got = losses(out2)  # the copy's history up to the resumed step, then the resumed run's
    assert all(ref_losses[k] == v for k, v in got.items())
    assert {k for k in ref_losses if k[1] > newest} <= set(got)
    for a, b in zip(ref_params, final_params(out2), strict=True):
        np.testing.assert_array_equal(a, b)
    summary = json.loads((out2 / "training_summary.json").read_text())
    assert summary["copies"][0]["to"] == url and summary["copies"][0]["failed"] == {}
    assert copied()[-1] == 60
    if where != "folder":  # the secret is nowhere: not in any output, file or object written
        texts += [r.stdout, r.stderr, written_text(out2), *(v.decode("utf-8", "replace") for v in cloud.objects().values())]
        if cloud.secret:
            assert not any(cloud.secret in t for t in texts)
            assert not any(cloud.secret.split("sig=")[-1][:20] in t for t in texts)


@pytest.mark.parametrize("where", ["s3", "gcs", "azure"])
def test_a_copy_comes_back_byte_for_byte(clouds, tmp_path, monkeypatch, where):
    """A step's files go to the bucket and come back exact: one ending in CR (gcp-storage-emulator stored it one byte
    short, so a run resumed from that copy fell back to an older step), in LF, an empty one and a nested one."""
    from tiny_lm.settings import run_config_from_args
    from tiny_lm.copies import Mirror, fetch_run
    from tiny_lm.flags import build_parser
    cloud = clouds(where)
    for name, value in cloud.env.items():
        monkeypatch.setenv(name, value)
    files = {"a": b"x\r", "b": b"\r\n", "c": b"", "d/e/f": bytes(range(256)) + b"\r", "g": b"y\n"}
    step = tmp_path / "run" / "checkpoint_step_3"
    for rel, data in files.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    flags = [a if a != PREFIX else "bytes" for a in cloud.flags]
    dest = run_config_from_args(build_parser().parse_args(["train", *flags, "--output-dir", str(tmp_path / "o")])).cloud
    mirror = Mirror(step.parent, dest, "bytes")
    mirror.submit(step.name)
    assert mirror.close(60) == {"to": dest.url, "copied": [step.name], "failed": {}}
    said = []
    back = fetch_run(dest, into=tmp_path / "back", say=said.append) / step.name
    assert {rel: (back / rel).read_bytes() for rel in files} == files and "instead" not in said[0], said


def test_unreachable_or_missing_bucket_fails_at_start(clouds, tmp_path):
    cloud = clouds("s3")
    out = tmp_path / "o"
    unreachable = {**cloud.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
                   "AWS_MAX_ATTEMPTS": "1"}  # botocore's retries off: the same one-line failure, without their back-off
    for env, bucket, message in [(cloud.env, "no-such-bucket", "does not exist"),
                                 (unreachable, BUCKET, "cannot write to s3://")]:
        flags = [a if a != BUCKET else bucket for a in cloud.flags]
        started = time.monotonic()
        r = tiny_lm("train", *RUN, *flags, "--output-dir", str(out), env=env)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert cloud.secret not in r.stderr + r.stdout
        assert not out.exists()  # checked before anything was written
        assert time.monotonic() - started < 90


def test_a_bucket_that_fails_mid_run_warns_and_training_goes_on(clouds, tmp_path):
    """The bucket is deleted after the first copy: the copies are retried with back-off and reported, and the run finishes."""
    cloud = clouds("s3")
    out = tmp_path / "o"
    cloud.fs.mkdir("doomed")
    p = start(out, *without(RUN, "--save-every"), "--save-every", "20", *[a if a != BUCKET else "doomed" for a in cloud.flags], env=cloud.env)
    wait_until(lambda: time.sleep(0.1) or cloud.fs.invalidate_cache() or cloud.fs.glob(f"doomed/{PREFIX}/*/tiny_lm_complete.json"), p)
    for _ in range(50):  # the run may add an object between the objects' deletion and the bucket's
        try:
            cloud.fs.rm("doomed", recursive=True)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise AssertionError("could not delete the bucket")
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert "retrying with back-off" in stdout and "training goes on" in stdout, stdout
    # once down, the bucket is not waited for again: the pruning's listing of the empty bucket brought the back-off
    # back for the run's JSON files once (15 s more at the end)
    assert stdout.count("retrying with back-off") == 1, stdout
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["total_steps"] == 60 and "final_checkpoint" in summary["copies"][0]["failed"]
    assert cloud.secret not in stdout + stderr + written_text(out)


def test_copy_flags_are_checked_before_any_work(tmp_path):
    """In this process (`in_process`: each case fails before any work, so a start-up would be the cost)."""
    out = tmp_path / "o"
    for flags, message in [(["--backup-dir", str(out / "backup")], "overlap"),
                           (["--cloud-bucket", "b"], "--cloud-bucket needs --cloud-provider"),
                           (["--cloud-provider", "s3"], "--cloud-provider needs --cloud-bucket"),
                           (["--cloud-provider", "gcs", "--cloud-bucket", "b", "--cloud-region", "eu"], "applies to --cloud-provider s3"),
                           (["--cloud-provider", "s3", "--cloud-bucket", "s3://b"], "is not a bucket name"),
                           (["--cloud-provider", "s3", "--cloud-bucket", "b", "--azure-sas-token", "sv=1&sig=TOPSECRET"], "apply to --cloud-provider azure")]:
        r = in_process("train", *RUN, *flags, "--output-dir", str(out))
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, (flags, stderr)
        assert "TOPSECRET" not in stderr + stdout
        assert not out.exists()


def doctor_a_bucket(cloud, victim: Path) -> str:
    """Two copied steps in the bucket; the newer one's record also lists a `../` name and an absolute path, whose objects
    exist (so a fetch that trusts the record writes them). Returns the copied run's URL."""
    prefix, up = f"{BUCKET}/doctored", os.pardir + "/"
    for step in (2, 4):
        cloud.fs.pipe(f"{prefix}/checkpoint_step_{step}/model/a", b"abc")
        cloud.fs.pipe(f"{prefix}/checkpoint_step_{step}/tiny_lm_complete.json", json.dumps({"files": {"model/a": 3}}).encode())
    evil = {"model/a": 3, f"{up}{up}escaped.txt": 4, str(victim): 4}
    for rel in evil:
        if rel != "model/a":
            cloud.fs.pipe(f"{prefix}/checkpoint_step_4/{rel}", b"evil")
    cloud.fs.pipe(f"{prefix}/checkpoint_step_4/tiny_lm_complete.json", json.dumps({"files": evil}).encode())
    cloud.fs.invalidate_cache()
    return f"s3://{prefix}"


def listing(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_doctored_bucket_record_writes_nothing_outside_the_run_folder(clouds, tmp_path):
    """Names in a copy's record are checked before anything is fetched: the step whose record names `../../escaped.txt`
    and an absolute path is skipped like a damaged one (the older good step is fetched, the warning says why); named
    itself, it fails with one line. Nothing is written outside the run folder."""
    from tiny_lm.copies import destination, fetch_run
    cloud = clouds("s3")
    victim = tmp_path / "victim.txt"
    url = doctor_a_bucket(cloud, victim)
    run = tmp_path / "runs" / "fetched"
    run.parent.mkdir()
    before = listing(tmp_path)
    said = []
    dest = destination(url, {"endpoint_url": cloud.env["AWS_ENDPOINT_URL"], "key": "testing", "secret": cloud.secret})
    assert fetch_run(dest, into=run, say=said.append) == run
    assert [p for p in listing(tmp_path) if not p.startswith("runs/fetched")] == before and not victim.exists()
    assert sorted(p.name for p in run.glob("checkpoint_step_*")) == ["checkpoint_step_2"]
    assert (run / "checkpoint_step_2" / "model" / "a").read_bytes() == b"abc"
    assert "step 4" in said[0] and "not a file inside its folder" in said[0] and "from step 2 instead" in said[0], said

    out = tmp_path / "o"
    r = tiny_lm("train", *RUN, *cloud.flags, "--resume-from", f"{url}/checkpoint_step_4", "--output-dir", str(out), env=cloud.env)
    assert r.returncode == 2 and "not a file inside its folder" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert [p for p in listing(tmp_path) if not p.startswith("runs/fetched")] == before and not victim.exists()


def test_sas_token_from_the_environment_reaches_azure_and_the_flag_warns(clouds, tmp_path, monkeypatch, capsys):
    """AZURE_STORAGE_SAS_TOKEN is the destination's token (a probe is written to Azurite with it, and it is a secret
    that messages hide); --azure-sas-token still works, with a warning that shows no token."""
    from tiny_lm.settings import run_config_from_args
    from tiny_lm.copies import check_destination
    from tiny_lm.flags import build_parser
    cloud = clouds("azure")
    for name, value in cloud.env.items():
        if name.startswith("AZURE_"):
            monkeypatch.setenv(name, value)
    args = ["train", *cloud.flags, "--output-dir", str(tmp_path / "o")]
    run = run_config_from_args(build_parser().parse_args(args))
    assert run.cloud.secrets == (cloud.secret,)
    check_destination(run.cloud)  # written, read back and deleted with the token from the environment
    assert capsys.readouterr().err == ""

    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN")
    run = run_config_from_args(build_parser().parse_args([*args, "--azure-sas-token", cloud.secret]))
    check_destination(run.cloud)
    err = capsys.readouterr().err
    assert "warning: --azure-sas-token" in err and "AZURE_STORAGE_SAS_TOKEN" in err and cloud.secret not in err, err
    assert not (tmp_path / "o").exists()
