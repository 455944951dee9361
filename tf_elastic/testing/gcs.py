"""TensorFlow's own `gs://` filesystem against a local GCS emulator, for tests (`pip install
gcp-storage-emulator cryptography`).

TensorFlow 2.21's GCS filesystem has no endpoint setting: `https://www.googleapis.com/storage/v1/`, its
upload twin and `storage.googleapis.com` are compiled in, and of the environment it reads only tuning
(`GCS_*`), credentials and `CURL_CA_BUNDLE`. Its libcurl does honour `https_proxy`/`http_proxy`, so a
proxy on 127.0.0.1 takes every request: it ends TLS with a certificate for those two hosts (trusted
through `CURL_CA_BUNDLE`) and hands the request to the emulator, in the form the emulator reads (a
relative target, no chunked body: TensorFlow uploads with chunked PUTs to the session URL the emulator
gave, which is plain `http://`). `GOOGLE_AUTH_TOKEN_FOR_TESTING` skips authentication. Nothing leaves
the machine.
"""
import contextlib
import datetime
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, Iterator

HOSTS = ("www.googleapis.com", "storage.googleapis.com")


@contextlib.contextmanager
def emulated_gcs(directory: Path, bucket: str) -> Iterator[Dict[str, str]]:
    """Runs the emulator (in memory, with `bucket`) and the proxy in a process of their own; yields the
    environment TensorFlow needs, to be set before a process first touches `gs://`. (Not threads of the
    test process: some TensorFlow calls hold the GIL while they wait for the answer.)"""
    proc = subprocess.Popen([sys.executable, "-m", "tf_elastic.testing.gcs", str(directory), bucket],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the GCS emulator did not start (exit code {proc.wait()}; see its stderr)")
        yield json.loads(line)
    finally:
        proc.kill()
        proc.wait()


def _serve(directory: Path, bucket: str) -> None:
    """Starts the emulator and the proxy, prints the environment (one JSON line), serves until killed."""
    from gcp_storage_emulator.handlers import objects
    from gcp_storage_emulator.server import create_server

    media_upload = objects._media_upload

    def empty_media_upload(request, response, storage):
        # The emulator takes an empty body for none; TensorFlow makes directories as empty objects.
        if request.data is None:
            request._data = b""
        return media_upload(request, response, storage)

    objects._media_upload = empty_media_upload
    emulator = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    emulator.start()
    port = emulator._api._httpd.server_address[1]
    certificate = _certificate(directory)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    proxy = socket.create_server(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{proxy.getsockname()[1]}"
    print(json.dumps({"https_proxy": address, "http_proxy": address, "CURL_CA_BUNDLE": certificate[0],
                      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "NO_GCE_CHECK": "true"}), flush=True)
    while True:
        client, _ = proxy.accept()
        threading.Thread(target=_handle, args=(client, context, port), daemon=True).start()


def _handle(client: socket.socket, context: ssl.SSLContext, port: int) -> None:
    """One request per connection (the emulator answers in HTTP/1.0 and closes): through a CONNECT
    tunnel, whose TLS ends here, or a plain `http://` request."""
    try:
        reader = client.makefile("rb")
        line = reader.readline()
        if line.startswith(b"CONNECT "):
            _headers(reader)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            reader.close()
            client = context.wrap_socket(client, server_side=True)
            reader = client.makefile("rb")
            line = reader.readline()
        _forward(line, reader, client, port)
    except (OSError, ValueError):
        pass  # the client went away; it retries
    finally:
        client.close()


def _headers(reader) -> list:
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b"\n", b""):
        lines.append(line)
    return lines


def _forward(line: bytes, reader, client: socket.socket, port: int) -> None:
    """Sends the request to the emulator with a relative target and a Content-Length body; relays the answer."""
    method, target, version = line.split(b" ", 2)
    target = re.sub(rb"^https?://[^/]+", b"", target)
    headers = _headers(reader)
    names = [h.split(b":", 1)[0].strip().lower() for h in headers]
    value = {n: h.split(b":", 1)[1].strip() for n, h in zip(names, headers)}
    if value.get(b"expect", b"").lower() == b"100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if value.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = b""
        while size := int(reader.readline().split(b";")[0], 16):
            body += reader.read(size)
            reader.readline()
        _headers(reader)  # trailers
    else:
        body = reader.read(int(value.get(b"content-length", 0)))
    kept = [h for n, h in zip(names, headers) if n not in (b"expect", b"transfer-encoding", b"content-length")]
    with socket.create_connection(("127.0.0.1", port)) as upstream:
        upstream.sendall(b" ".join([method, target, version]) + b"".join(kept)
                         + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while data := upstream.recv(1 << 16):
            client.sendall(data)


def _certificate(directory: Path):
    """A self-signed certificate for `HOSTS` and its key, as files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTS[0])])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in HOSTS]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "gcs-emulator.pem", directory / "gcs-emulator.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), sys.argv[2])
