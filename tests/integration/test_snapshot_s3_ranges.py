"""A snapshot on an S3 endpoint that ignores Range (found attacking issue 24, item 3: "bounded
remote reads, per backend"). Reads went through s3fs's ``cat_file``, which reads the whole
response body before shmcache can check its length: a manifest read (64 MiB at most) from an
endpoint that answered every GetObject with 200 and 512 MiB took 1,060 MiB; an endless body
took whatever it sent. Now an S3 read is shmcache's own ranged GetObject, read a chunk at a time
up to the range and then closed (location._S3Reader), and a whole-object answer to a range that
does not start at 0 is refused unread (RangeNotHonored), as over HTTP. The endpoint is a real
socket server on 127.0.0.1 in a thread that counts what it managed to send; the reader runs in
a subprocess where its peak memory is measured."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("s3fs")

MiB = 1 << 20
BODY_MIB = 384


class _IgnoresRange(http.server.BaseHTTPRequestHandler):
    """Every GET: 200 and BODY_MIB MiB of zeros, whatever the Range; the bytes that reached the
    socket are counted in ``sent``."""

    protocol_version = "HTTP/1.1"
    sent: list

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(BODY_MIB * MiB))
        self.end_headers()
        n = 0
        try:
            for _ in range(BODY_MIB):
                self.wfile.write(bytes(MiB))
                n += MiB
        except OSError:
            pass
        finally:
            self.sent.append(n)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    sent: list = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_IgnoresRange,), {"sent": sent}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", sent
    server.shutdown()
    server.server_close()
    thread.join(5)


_READER = textwrap.dedent("""
    import json, resource, sys
    from shmcache.errors import RangeNotHonored, SnapshotError
    from shmcache.snapshot.load import read_manifest
    from shmcache.snapshot.location import open_location
    opts = {"client_kwargs": {"endpoint_url": sys.argv[1]}, "key": "testing", "secret": "testing"}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    try:
        read_manifest("s3://bucket/snap", opts)
    except SnapshotError as exc:
        out["manifest"] = str(exc)
    try:
        open_location("s3://bucket/snap", opts).read_range("seg-00000.shms", 1 << 20, 2 << 20)
    except (RangeNotHonored, OSError) as exc:
        out["range"] = f"{type(exc).__name__}: {exc}"
    out["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    print(json.dumps(out))
""")


def test_an_s3_endpoint_that_ignores_range_costs_the_range_asked_for(endpoint):
    url, sent = endpoint
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    proc = subprocess.run([sys.executable, "-c", _READER, url], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "more than the 67108864 such a file may have" in out.get("manifest", ""), out
    assert out.get("range", "").startswith("RangeNotHonored:") and "ignores HTTP Range" in out["range"], out
    assert out["grew_mib"] < 200, out  # the 64 MiB asked for (and its copy), not the 384 MiB sent
    assert sum(sent) < BODY_MIB * MiB // 2, f"the endpoint sent {sum(sent) >> 20} MiB"
