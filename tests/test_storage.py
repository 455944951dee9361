"""Durable copies on s3:// through boto3, against a real S3 API on 127.0.0.1 (moto's server): parts above the
part size, partial copies and their multipart uploads collected, clear errors for a missing bucket and
denied access. (A job killed mid-copy and restarted on empty hosts from the bucket: tests/test_group_state.py.)"""
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_elastic.elastic.worker.durable import MARKER, DurableCopies
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.storage import Storage, StorageError, open_storage
from tf_elastic.testing.local_job import REPO, repo_env

pytest.importorskip("boto3", reason="s3:// needs boto3 (the test extra)")
pytest.importorskip("moto.server", reason='S3 is tested against moto\'s server: pip install "moto[server]"')
from tf_elastic.elastic.worker.storage_s3 import S3Storage  # noqa: E402
from tf_elastic.testing.s3 import local_s3  # noqa: E402

MiB = 1024 * 1024


def _commit_files(directory, name, sizes):
    """A stand-in for a commit's files: `name.*`, of the given sizes in bytes; returns the prefix."""
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, name)
    for suffix, size in sizes.items():
        with open(f"{prefix}.{suffix}", "wb") as f:
            f.write(np.random.default_rng(size).bytes(size))
    return prefix


def test_the_scheme_chooses_the_storage():
    assert type(open_storage("/tmp/x")) is Storage and type(open_storage("gs://b/x")) is Storage
    assert type(open_storage("s3://bucket/job")) is S3Storage
    with pytest.raises(ValueError, match="part_size=.*at least 5 MiB"):
        S3Storage(part_size=MiB)


def test_a_copy_above_the_part_size_goes_in_parts_and_comes_back_whole(s3, tmp_path):
    storage = S3Storage(part_size=5 * MiB)
    copies = DurableCopies("s3://bucket/job", storage=storage)
    prefix = _commit_files(tmp_path / "host", "ckpt-0-10-0-160", {"index": 300, "data-00000-of-00001": 11 * MiB})
    assert copies.copy(prefix) == 11 * MiB + 300
    head = storage.client.head_object(Bucket="bucket", Key="job/ckpt-0-10-0-160/ckpt-0-10-0-160.data-00000-of-00001")
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # 5 + 5 + 1 MiB
    assert copies.copy(prefix) == 0  # complete already
    newest = copies.newest()
    local = copies.readable(newest, str(tmp_path / "fetched"))
    assert local == str(tmp_path / "fetched" / "ckpt-0-10-0-160" / "ckpt-0-10-0-160")
    for suffix in ("index", "data-00000-of-00001"):
        with open(f"{prefix}.{suffix}", "rb") as a, open(f"{local}.{suffix}", "rb") as b:
            assert a.read() == b.read()


def test_partial_copies_and_their_unfinished_uploads_are_collected(s3, tmp_path):
    """A copy killed mid-upload leaves files without the marker and a multipart upload S3 keeps (and bills)
    until aborted: neither counts, and the next complete copy collects both."""
    storage = S3Storage()
    copies = DurableCopies("s3://bucket/job", keep=1, storage=storage)
    copies.copy(_commit_files(tmp_path, "ckpt-0-10-0-160", {"index": 100, "data": 1000}))
    storage.write_text("s3://bucket/job/ckpt-0-20-0-320/ckpt-0-20-0-320.index", "cut short")
    storage.client.create_multipart_upload(Bucket="bucket", Key="job/ckpt-0-20-0-320/ckpt-0-20-0-320.data")
    assert [(c.step, c.complete) for c in copies.copies()] == [(10, True), (20, False)]
    assert copies.newest().step == 10
    copies.copy(_commit_files(tmp_path, "ckpt-0-30-0-480", {"index": 100, "data": 1000}))
    assert [(c.step, c.complete) for c in copies.copies()] == [(30, True)]
    assert storage.client.list_multipart_uploads(Bucket="bucket").get("Uploads", []) == []


def test_generation_marks_only_grow_on_s3(s3):
    copies = DurableCopies("s3://bucket/job")
    assert copies.generation_mark() == -1
    copies.mark_generation(4)
    copies.mark_generation(2)
    assert copies.generation_mark() == 4 and copies.storage.listdir("s3://bucket/job") == ["GENERATION-4"]


def test_a_missing_bucket_and_denied_access_are_clear_errors_naming_the_bucket(s3):
    with pytest.raises(ConfigurationError, match=r"--checkpoint_dir=s3://missing/job cannot be written "
                                                 r"\(StorageError: .*the bucket missing does not exist\)"):
        DurableCopies("s3://missing/job").check_writable()
    with local_s3("bucket", read_only=True) as env:
        os.environ.update(env)  # (the fixture's monkeypatch restores the variables afterwards)
        with pytest.raises(ConfigurationError, match=r"--checkpoint_dir=s3://bucket/job cannot be written .*"
                                                     r"access denied \(AccessDenied"):
            DurableCopies("s3://bucket/job").check_writable()
        secret = env["AWS_SECRET_ACCESS_KEY"]
        with pytest.raises(StorageError) as denied:
            S3Storage().write_text("s3://bucket/job/x", "x")
        assert secret not in str(denied.value)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "denied"])
def test_a_worker_exits_78_naming_a_missing_or_denied_bucket(s3, tmp_path, case):
    """At start, before any training: the chief's probe write is refused (a read-only user on an S3 server
    that checks every request, for `denied`)."""
    with contextlib.ExitStack() as stack:
        env = stack.enter_context(local_s3("bucket", read_only=True)) if case == "denied" else s3
        bucket = "no-such-bucket" if case == "missing" else "bucket"
        proc = subprocess.run([sys.executable, "-m", "launch.train", "--dataset=digits", "--epochs=1", "--threads=1",
                               f"--run_dir={tmp_path}", f"--checkpoint_dir=s3://{bucket}/job"],
                              cwd=REPO, env=repo_env(**env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert f"--checkpoint_dir=s3://{bucket}/job cannot be written" in proc.stderr
    reason = "the bucket no-such-bucket does not exist" if case == "missing" else "access denied (AccessDenied"
    assert reason in proc.stderr, proc.stderr[-3000:]
    if case == "denied":  # (the missing case's key is the word "testing")
        assert env["AWS_SECRET_ACCESS_KEY"] not in proc.stderr + proc.stdout


def test_a_copy_that_fails_later_is_a_storage_error_not_a_crash(s3, tmp_path):
    """What `CommittedState` catches and logs (an OSError): the bucket deleted under a running job."""
    storage = S3Storage()
    storage.rmtree("s3://bucket/")
    storage.client.delete_bucket(Bucket="bucket")
    with pytest.raises(OSError, match="the bucket bucket does not exist"):
        DurableCopies("s3://bucket/job", storage=storage).copy(_commit_files(tmp_path, "ckpt-0-1-0-1", {"index": 1}))


def test_the_marker_is_written_last(s3, tmp_path):
    """When the marker is written every file is up: a kill before it leaves a partial copy."""
    copies = DurableCopies("s3://bucket/job")
    seen, write_marker = [], copies._write_marker

    def look_then_write_marker(folder, name):
        seen.append(sorted(copies.storage.listdir(folder)))
        write_marker(folder, name)

    copies._write_marker = look_then_write_marker
    copies.copy(_commit_files(tmp_path, "ckpt-0-1-0-1", {"index": 10, "data": 10}))
    assert seen == [["ckpt-0-1-0-1.data", "ckpt-0-1-0-1.index"]]
    assert MARKER in copies.storage.listdir("s3://bucket/job/ckpt-0-1-0-1")

