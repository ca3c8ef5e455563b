"""Which S3 client for the remote store: boto3 against obstore, on the real Ceph RADOS Gateway (loopback).

Both move the same data the way the remote store does: 16 MiB content-addressed chunk objects in
parallel (PUT, GET), plus one large object by multipart upload and ranged parallel GETs, and both
check that ``PUT If-None-Match: *`` on an existing key is refused. Writes bench/results/s3-clients-*.json.

    .venv/bin/python bench/s3_clients.py [--mib 256] [--threads 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import ceph_rgw  # noqa: E402

CHUNK = 16 << 20


def _boto3(gw: ceph_rgw.Gateway, bucket: str, threads: int) -> dict[str, Any]:
    from boto3.s3.transfer import TransferConfig

    s3 = gw.s3_client(max_pool_connections=threads * 2)
    s3.create_bucket(Bucket=bucket)

    def put(key: str, data: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=data)

    def get(key: str) -> bytes:
        return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    def get_range(key: str, start: int, end: int) -> bytes:
        return bytes(s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read())

    def put_multipart(key: str, path: Path) -> None:
        s3.upload_file(
            str(path),
            bucket,
            key,
            Config=TransferConfig(multipart_chunksize=CHUNK, max_concurrency=threads, multipart_threshold=CHUNK),
        )

    def put_if_absent(key: str, data: bytes) -> bool:
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except s3.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "412"):
                return False
            raise

    return {
        "put": put,
        "get": get,
        "get_range": get_range,
        "put_multipart": put_multipart,
        "put_if_absent": put_if_absent,
    }


def _obstore(gw: ceph_rgw.Gateway, bucket: str, threads: int) -> dict[str, Any]:
    import obstore
    from obstore.store import S3Store

    _boto3(gw, bucket, threads)  # obstore has no bucket API: boto3 creates the bucket
    store = S3Store(
        bucket,
        endpoint=gw.endpoint,
        region=ceph_rgw.REGION,
        access_key_id=ceph_rgw.ACCESS_KEY,
        secret_access_key=ceph_rgw.SECRET_KEY,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )

    def put(key: str, data: bytes) -> None:
        obstore.put(store, key, data)

    def get(key: str) -> bytes:
        return bytes(obstore.get(store, key).bytes())

    def get_range(key: str, start: int, end: int) -> bytes:
        return bytes(obstore.get_range(store, key, start=start, end=end))

    def put_multipart(key: str, path: Path) -> None:
        obstore.put(store, key, path, use_multipart=True, chunk_size=CHUNK, max_concurrency=threads)

    def put_if_absent(key: str, data: bytes) -> bool:
        try:
            obstore.put(store, key, data, mode="create")
            return True
        except obstore.exceptions.AlreadyExistsError:
            return False

    return {
        "put": put,
        "get": get,
        "get_range": get_range,
        "put_multipart": put_multipart,
        "put_if_absent": put_if_absent,
    }


def _measure(name: str, ops: dict[str, Any], mib: int, threads: int, scratch: Path) -> dict[str, Any]:
    n = mib * (1 << 20) // CHUNK
    chunks = [os.urandom(CHUNK) for _ in range(n)]
    total = n * CHUNK
    out: dict[str, Any] = {"client": name}
    with ThreadPoolExecutor(threads) as pool:
        t = time.monotonic()
        list(pool.map(lambda i: ops["put"](f"{name}/chunks/{i}", chunks[i]), range(n)))
        out["chunk_put_MiBps"] = round(total / 2**20 / (time.monotonic() - t), 1)
        t = time.monotonic()
        got = list(pool.map(lambda i: ops["get"](f"{name}/chunks/{i}"), range(n)))
        out["chunk_get_MiBps"] = round(total / 2**20 / (time.monotonic() - t), 1)
        assert all(hashlib.sha256(a).digest() == hashlib.sha256(b).digest() for a, b in zip(got, chunks, strict=True))
        del got
        big = scratch / f"{name}.bin"
        with open(big, "wb") as fh:
            for c in chunks:
                fh.write(c)
        t = time.monotonic()
        ops["put_multipart"](f"{name}/big", big)
        out["multipart_put_MiBps"] = round(total / 2**20 / (time.monotonic() - t), 1)
        big.unlink()
        t = time.monotonic()
        parts = list(pool.map(lambda i: ops["get_range"](f"{name}/big", i * CHUNK, (i + 1) * CHUNK), range(n)))
        out["ranged_get_MiBps"] = round(total / 2**20 / (time.monotonic() - t), 1)
        assert b"".join(parts) == b"".join(chunks)
    out["if_none_match_new_key_written"] = ops["put_if_absent"](f"{name}/manifest", b"{}")
    out["if_none_match_existing_key_refused"] = not ops["put_if_absent"](f"{name}/manifest", b"{}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    gw = ceph_rgw.start()
    scratch = Path("/var/tmp")
    try:
        results = []
        for r in range(args.rounds):  # interleaved, so neither gets a quieter machine
            for name, make in (("boto3", _boto3), ("obstore", _obstore)):
                res = _measure(name, make(gw, f"bench-{name}-{r}", args.threads), args.mib, args.threads, scratch)
                res["round"] = r
                print(json.dumps(res), flush=True)
                results.append(res)
    finally:
        gw.stop()
    doc = {
        "bench": "s3-clients",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "server": "Ceph RADOS Gateway 16.2 (Debian 12), memstore OSD, loopback",
        "mib": args.mib,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "results": results,
    }
    out = REPO / "bench" / "results" / f"s3-clients-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
