"""app.py served as a user starts it (`python app.py ... --port N`): a free port, the wait for the page,
and the stop, for the page measurements in offline/ and the tests that drive a real server."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Return once `url` answers 200; RuntimeError if `process` exits first, TimeoutError after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited early with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"app.py did not answer on {url} within {timeout} s")


def stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate the server, killing it if it does not exit within `timeout` s."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()


@contextlib.contextmanager
def served_app(*args: str, env: dict[str, str] | None = None, log: Path | None = None,
               timeout: float = 900) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python app.py ARGS --port N` in the repository, its output in `log` (else dropped), `env` over
    this process's environment; yields (url, process) once the page answers, and stops it afterwards."""
    port = free_port()
    with open(log, "w") if log else open(os.devnull, "w") as out:
        process = subprocess.Popen([sys.executable, "app.py", *args, "--port", str(port)], cwd=REPO,
                                   env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url, process, timeout)
        yield url, process
    finally:
        stop(process)
