"""Reaching a path or URL, for the corpus (corpus/sources.py) and the snapshot store
(snapshots/storage.py) alike: which library reads which URL, the S3 client, S3's error codes, and
what to fix when storage fails.

It sits below both so that reading an s3:// corpus does not import the snapshot code, and so the
two read URLs by the same rules: an endpoint, a bucket or credentials that work for one work for
the other, and fail with the same hint.
"""

from __future__ import annotations


def backend_of(url: str) -> tuple[str, str]:
    """Which library reads url, and what to hand it: ("local", path) for a plain path or file://,
    ("s3", url) for s3:// (boto3), ("fsspec", url) for any other scheme (memory://, gs://...)."""
    if url.startswith("s3://"):
        return "s3", url
    if "://" in url and not url.startswith("file://"):
        return "fsspec", url
    return "local", url.removeprefix("file://")


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key) of s3://bucket/key. Not urlparse: a key may hold '?' or '#' (and a corpus
    glob '[...]'), which urlparse would cut off as a query or a fragment."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def s3_client(endpoint_url: str = ""):
    """A boto3 S3 client: standard retries with backoff, bounded connect/read timeouts, endpoint
    from the argument or the usual AWS sources (AWS_ENDPOINT_URL, ~/.aws/config)."""
    import boto3  # imported on first use: jobs that never touch S3 do not pay for boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or None,
        config=Config(
            retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=120
        ),
    )


def s3_error_code(error: Exception) -> str | None:
    """S3's error code ("404", "NoSuchKey", "PreconditionFailed"...) of a botocore ClientError;
    None for any other exception, so callers need not import botocore to ask."""
    return getattr(error, "response", {}).get("Error", {}).get("Code")


def storage_hint(error: Exception, setting: str, otherwise: str) -> str:
    """What to fix, for the storage errors people actually hit (setting: the config key naming the
    URL; otherwise: the hint for any other error)."""
    text = f"{type(error).__name__}: {error}"
    if (
        "Credentials" in type(error).__name__
        or "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
    ):
        return (
            "check the AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
        )
    if "NoSuchBucket" in text:
        return f"create the bucket or fix the bucket name in {setting}"
    if "EndpointConnection" in type(error).__name__ or "Connect" in type(error).__name__:
        return (
            "check trainer_config.s3_endpoint_url / AWS_ENDPOINT_URL "
            "and that the server is reachable"
        )
    return otherwise
