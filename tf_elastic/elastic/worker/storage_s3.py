"""`s3://bucket/prefix` for durable copies, through boto3 (Amazon S3 and S3-compatible stores: MinIO, Ceph,
R2). boto3 rather than fsspec/s3fs: it is AWS's own maintained client, s3fs pins aiobotocore to narrow
botocore versions, and boto3's transfer manager already uploads a large file in parallel parts.

Credentials and endpoints are the client's own: its usual chain (environment, `~/.aws` profile, instance
or pod role) and `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for an S3-compatible store. A file above
`part_size` bytes is uploaded in parts (S3 requires at least 5 MiB a part). "Directories" are key
prefixes: nothing is created for them, and a listing with delimiter `/` reads them. Errors name the path
and the reason (a missing bucket, access denied, no credentials), never a credential. A copy killed
mid-upload leaves a multipart upload that S3 keeps, and bills, until it is aborted: `rmtree`, which the
collection of partial copies calls, aborts those under its prefix (a bucket lifecycle rule
`AbortIncompleteMultipartUpload` is a good second line).

Durable copies only: training data on S3 is read through a mount (Mountpoint for Amazon S3, s3fs-fuse)
given as a local path. A `Source` over S3 objects would need boto3 inside the tf.data graph
(`tf.py_function`), which holds the GIL for each read and serializes what tf.data's parallel reads overlap.
"""
import contextlib
import os
from typing import Iterator, List, Tuple

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from tf_elastic.elastic.worker.storage import Storage, StorageError

PART_SIZE = 8 * 1024 * 1024  # boto3's default part size
_CLIENT_CONFIG = botocore.config.Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10,
                                        read_timeout=60)


def from_url(url: str) -> "S3Storage":
    return S3Storage()


class S3Storage(Storage):
    reads_directly = False  # TensorFlow 2.21 has no s3:// filesystem: a copy is downloaded to be read

    def __init__(self, part_size: int = PART_SIZE):
        if part_size < 5 * 1024 * 1024:
            raise ValueError(f"part_size={part_size}: S3 takes parts of at least 5 MiB (5242880 bytes)")
        self.client = boto3.session.Session().client("s3", config=_CLIENT_CONFIG)
        self.transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size)

    def listdir(self, directory: str) -> List[str]:
        bucket, prefix = _split(directory, folder=True)
        names = []
        with _reasons(directory):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                                              Delimiter="/"):
                names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", ())]
                names += [o["Key"][len(prefix):] for o in page.get("Contents", ())]
        return [name for name in names if name]

    def exists(self, path: str) -> bool:
        bucket, key = _split(path)
        try:
            with _reasons(path):
                self.client.head_object(Bucket=bucket, Key=key)
            return True
        except StorageError as error:
            if error.status == 404:
                return False
            raise

    def makedirs(self, directory: str) -> None:
        pass  # prefixes need no object

    def write_text(self, path: str, text: str) -> None:
        bucket, key = _split(path)
        with _reasons(path):
            self.client.put_object(Bucket=bucket, Key=key, Body=text.encode())

    def upload(self, local_path: str, path: str) -> int:
        bucket, key = _split(path)
        with _reasons(path):
            self.client.upload_file(local_path, bucket, key, Config=self.transfer)
        return os.path.getsize(local_path)

    def download(self, directory: str, local_directory: str) -> None:
        bucket, prefix = _split(directory, folder=True)
        os.makedirs(local_directory, exist_ok=True)
        for name in self.listdir(directory):
            with _reasons(directory + "/" + name):
                self.client.download_file(bucket, prefix + name, os.path.join(local_directory, name),
                                          Config=self.transfer)

    def remove(self, path: str) -> None:
        bucket, key = _split(path)
        with _reasons(path):
            self.client.delete_object(Bucket=bucket, Key=key)

    def rmtree(self, directory: str) -> None:
        """Deletes every object under `directory`, and aborts the multipart uploads begun there (a copy
        killed mid-upload leaves its parts stored, and billed, until then)."""
        bucket, prefix = _split(directory, folder=True)
        with _reasons(directory):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:  # a page holds at most 1000 keys, as many as one delete_objects takes
                    self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
                for upload in page.get("Uploads", ()):
                    self.client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def _split(url: str, folder: bool = False) -> Tuple[str, str]:
    """("bucket", "key") of `s3://bucket/key`; a folder's key ends with `/` (or is empty: the bucket)."""
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"{url}: no bucket named (s3://BUCKET/PREFIX)")
    key = key.strip("/") if folder else key
    return bucket, key + "/" if folder and key else key


@contextlib.contextmanager
def _reasons(path: str) -> Iterator[None]:
    """Turns boto3's errors into `StorageError("PATH: reason", HTTP status)`."""
    try:
        yield
    except botocore.exceptions.ClientError as error:
        raise _storage_error(path, error) from None
    except boto3.exceptions.S3UploadFailedError as error:  # the transfer manager's wrapping of a ClientError
        cause = error.__context__
        raise (_storage_error(path, cause) if isinstance(cause, botocore.exceptions.ClientError)
               else StorageError(f"{path}: {error}")) from None
    except botocore.exceptions.NoCredentialsError:
        raise StorageError(f"{path}: no AWS credentials found (environment, ~/.aws profile, instance or pod "
                           "role)") from None
    except botocore.exceptions.BotoCoreError as error:
        raise StorageError(f"{path}: {type(error).__name__}: {error}") from None


def _storage_error(path: str, error: botocore.exceptions.ClientError) -> StorageError:
    details = error.response.get("Error", {})
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code, message = details.get("Code", ""), details.get("Message", "")
    if code == "NoSuchBucket" or (status == 404 and "bucket" in message.lower()):
        reason = f"the bucket {_split(path)[0]} does not exist"
    elif status == 403:
        reason = f"access denied ({code}: {message}): the credentials' policy must allow reading, writing " \
                 "and listing under this prefix"
    else:
        reason = f"{code or status}: {message}"
    return StorageError(f"{path}: {reason}", status)
