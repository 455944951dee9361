"""A real S3 API on 127.0.0.1 for tests and benchmarks: moto's server (`pip install "moto[server]"`, the test
extra), in a process of its own, speaking the wire protocol boto3 speaks to AWS.

`local_s3` yields the environment a process needs to reach it the way AWS users configure an
S3-compatible store (`AWS_ENDPOINT_URL`, keys, region). With `read_only=True` the server checks every
request against its IAM users, and the keys are those of a user whose policy allows listing and
reading the bucket but not writing to it.
"""
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Dict, Iterator

from tf_elastic.testing.net import free_port

SETUP_REQUESTS = 4  # requests an enforcing server serves before it checks: the bucket, the user, its policy and keys


@contextlib.contextmanager
def local_s3(bucket: str, read_only: bool = False, timeout: float = 60.0) -> Iterator[Dict[str, str]]:
    """Runs moto's S3 server with `bucket` created; yields the client environment (strings, for
    `os.environ` or a child's env)."""
    port = free_port()
    env = dict(os.environ)
    if read_only:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_REQUESTS)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_until_up(endpoint, proc, timeout)
        client_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                      "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        _client(client_env, "s3").create_bucket(Bucket=bucket)
        yield _read_only_user(client_env, bucket) if read_only else client_env
    finally:
        proc.kill()
        proc.wait()


def _read_only_user(env: Dict[str, str], bucket: str) -> Dict[str, str]:
    """The environment of a new IAM user who may list and read `bucket` but not write to it."""
    iam = _client(env, "iam")
    iam.create_user(UserName="reader")
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject"],
        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    return {**env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


def _client(env: Dict[str, str], service: str):
    import boto3

    return boto3.session.Session(aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                 region_name=env["AWS_DEFAULT_REGION"]).client(service,
                                                                               endpoint_url=env["AWS_ENDPOINT_URL"])


def _wait_until_up(endpoint: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto's S3 server exited with {proc.returncode} (is moto[server] installed?)")
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto's S3 server did not answer at {endpoint} within {timeout} s")
