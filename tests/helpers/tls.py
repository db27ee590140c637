"""Self-signed certificates for the TLS tests (gRPC, the dashboard, /metrics)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (the docs/slurm.md recipe):
    ``(directory/<name>.pem, directory/<name>.key)``.

    Raises:
        subprocess.CalledProcessError: openssl failed.
    """
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
