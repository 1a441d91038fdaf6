"""`vllm serve` with `"method": "eagle2"` on the bundled pair, end to end over HTTP.

One OpenAI-compatible server (its own process group on 127.0.0.1, a free port)
serves the whole module; the `openai` client talks to it. Greedy output must be
exactly what vanilla vLLM (no speculation, same dtype / eager mode / context)
produces offline for the same prompt: completions and chat completions,
streamed and not. /metrics must show drafts and accepted draft tokens.

The vanilla reference is computed in this process (in-process engine,
tests/conftest.py) while the server boots, to overlap the two start-ups.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_eagle_tree import assets
from vllm_eagle_tree.plugin import REGISTRY_ENV
from vllm_helpers import free_llm, make_llm

# Server start-up dominates (the offline reference is overlapped with it): the
# module takes ~40 s on 2 idle CPU cores, 60-75 s on a loaded machine.
pytestmark = pytest.mark.slow

MAX_TOKENS = 24
TREE = {"num_nodes": 16, "max_depth": 4, "top_k": 4}
PROMPTS = assets.heldout_prompts(3)
# Chat turns built from held-out code, so the drafts have something to accept.
CHATS = [
    [{"role": "user", "content": PROMPTS[0]}],
    [{"role": "system", "content": "Continue the file."},
     {"role": "user", "content": PROMPTS[2]}],
]
# A template of our own (the bundled target ships one too): passed to the
# server with --chat-template and to the offline reference's LLM.chat.
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)
SERVED_NAME = "eagle2-target"
STARTUP_TIMEOUT_S = 600.0   # ~35-60 s on 2 idle CPU cores; generous for a busy box
REQUEST_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 60.0
# Greedy + ignore_eos: every request decodes exactly MAX_TOKENS tokens.
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


# ---------------------------------------------------------------------------
# Server process
# ---------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    registry_path: Path
    template_path: Path
    log_file: object = field(repr=False)

    def log_tail(self, n: int = 80) -> str:
        self.log_file.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:  # pragma: no cover
            return f"<no server log: {exc}>"
        return "\n".join(lines[-n:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it if the test process dies (even by
    SIGKILL, where no fixture teardown runs). Linux only; best effort."""
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:  # pragma: no cover
        pass


def _vllm_cli() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("vllm")
    if found:
        return [found]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the server and everything it started: SIGTERM to the API server
    first (it shuts its engine core and worker down in order; signalling the
    whole group at once kills the engine core under it, which logs an
    EngineDeadError traceback), then SIGTERM / SIGKILL to whatever is left in
    its process group (start_new_session: the group id is the server's pid)."""
    pgid = proc.pid

    def wait_group(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return True
            time.sleep(0.2)
        return False

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    for sig, grace in ((None, SHUTDOWN_GRACE_S), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if sig is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        if wait_group(grace):
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    """Starts `vllm serve TARGET --speculative-config {eagle2...}` and does not
    wait for it (see `client`); stops the whole process group at the end."""
    target, eagle1_head, _ = pair
    workdir = tmp_path_factory.mktemp("serve")
    template_path = workdir / "chat_template.jinja"
    template_path.write_text(CHAT_TEMPLATE)
    log_path = workdir / "server.log"
    registry_path = workdir / "registered.txt"
    port = _free_port()
    spec = {"method": "eagle2", "model": eagle1_head, **TREE}
    cmd = _vllm_cli() + [
        "serve", target,
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--seed", "0",
        "--chat-template", str(template_path),
        "--speculative-config", json.dumps(spec),
    ]
    env = dict(os.environ)
    # Serve the way a user would: vLLM's own process layout, no Triton interpreter.
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TRITON_INTERPRET"):
        env.pop(name, None)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env[REGISTRY_ENV] = str(registry_path)

    log_file = open(log_path, "w")
    log_file.write("$ " + " ".join(cmd) + "\n")
    log_file.flush()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path, registry_path,
                 template_path, log_file)
    try:
        yield srv
    finally:
        _stop_group(proc)
        log_file.close()


def _wait_healthy(srv: Server) -> None:
    start = time.monotonic()
    while True:
        code = srv.proc.poll()
        if code is not None:
            pytest.fail(f"vllm serve exited with code {code} before becoming healthy; "
                        f"log tail:\n{srv.log_tail()}", pytrace=False)
        try:
            with urllib.request.urlopen(srv.base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() - start > STARTUP_TIMEOUT_S:
            pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S:.0f} s; "
                        f"log tail:\n{srv.log_tail()}", pytrace=False)
        time.sleep(1.0)


# ---------------------------------------------------------------------------
# Vanilla reference (offline, no speculation)
# ---------------------------------------------------------------------------
@dataclass
class Ref:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]


def _ref(o) -> Ref:
    return Ref(o.outputs[0].text, list(o.outputs[0].token_ids), list(o.prompt_token_ids))


@pytest.fixture(scope="module")
def reference(pair, server):
    """Vanilla vLLM's greedy outputs, offline. Depends on `server` only so that
    it is computed while the server is starting."""
    from vllm import SamplingParams

    target = pair[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(model=target)
    try:
        completions = [_ref(o) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        chats = [_ref(o) for o in llm.chat(CHATS, params, use_tqdm=False,
                                           chat_template=CHAT_TEMPLATE)]
    finally:
        free_llm(llm)
    for ref in completions + chats:
        assert len(ref.token_ids) == MAX_TOKENS
    return {"completion": completions, "chat": chats}


@pytest.fixture(scope="module")
def client(server, reference):
    """An OpenAI client on the server, once /health answers."""
    import openai

    _wait_healthy(server)
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY",
                         timeout=REQUEST_TIMEOUT_S, max_retries=0)


# Non-streamed responses, shared between tests (each request is greedy).
_CACHE: dict = {}


def _completion(client, i: int):
    key = ("completion", i)
    if key not in _CACHE:
        _CACHE[key] = client.completions.create(
            model=SERVED_NAME, prompt=PROMPTS[i], extra_body=EXTRA, **GREEDY)
    return _CACHE[key]


def _chat(client, i: int):
    key = ("chat", i)
    if key not in _CACHE:
        _CACHE[key] = client.chat.completions.create(
            model=SERVED_NAME, messages=CHATS[i], extra_body=EXTRA, **GREEDY)
    return _CACHE[key]


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_completion_equals_vanilla(client, reference, i):
    resp = _completion(client, i)
    ref = reference["completion"][i]
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert choice.prompt_token_ids == ref.prompt_token_ids
    assert choice.token_ids == ref.token_ids
    assert choice.text == ref.text


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_completion_stream_equals_non_stream(client, reference, i):
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[i], stream=True,
                                       extra_body=EXTRA, **GREEDY)
    pieces, ids, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.text or "")
            ids += getattr(c, "token_ids", None) or []
            finish = c.finish_reason or finish
    assert finish == "length"
    assert ids == _completion(client, i).choices[0].token_ids
    assert "".join(pieces) == _completion(client, i).choices[0].text
    assert "".join(pieces) == reference["completion"][i].text


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_equals_vanilla(client, reference, i):
    resp = _chat(client, i)
    ref = reference["chat"][i]
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert resp.prompt_token_ids == ref.prompt_token_ids  # same template rendering
    assert choice.token_ids == ref.token_ids
    assert choice.message.content == ref.text


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_stream_equals_non_stream(client, reference, i):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=CHATS[i], stream=True,
                                            extra_body=EXTRA, **GREEDY)
    pieces, ids, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            ids += getattr(c, "token_ids", None) or []
            finish = c.finish_reason or finish
    assert finish == "length"
    assert ids == _chat(client, i).choices[0].token_ids
    assert "".join(pieces) == _chat(client, i).choices[0].message.content
    assert "".join(pieces) == reference["chat"][i].text


_SAMPLE = re.compile(r"^(?P<name>vllm:[a-z_]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def _metrics(srv: Server) -> dict[str, list[tuple[str, float]]]:
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples.setdefault(m["name"], []).append((m["labels"] or "", float(m["value"])))
    return samples


def _total(samples, name) -> float:
    return sum(v for _, v in samples.get(name, []))


def test_metrics_show_tree_speculation(server, client):
    _completion(client, 0)  # at least one request, also when run alone
    deadline = time.monotonic() + 30
    while True:
        samples = _metrics(server)
        drafts = _total(samples, "vllm:spec_decode_num_drafts_total")
        if drafts > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    accepted = _total(samples, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = _total(samples, "vllm:spec_decode_num_draft_tokens_total")
    assert drafts > 0, sorted(samples)
    assert accepted > 0
    assert accepted <= drafted
    # One draft tree per step, sized num_nodes (vLLM counts num_speculative_tokens).
    assert drafted == drafts * TREE["num_nodes"]
    # An accepted tree path holds at most max_depth draft tokens: deeper
    # positions never accept (a 16-token chain would allow 16).
    per_pos = {}
    for labels, v in samples.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []):
        m = re.search(r'position="(\d+)"', labels)
        if m:
            per_pos[int(m[1])] = per_pos.get(int(m[1]), 0.0) + v
    assert per_pos, "no per-position acceptance counters"
    assert sum(per_pos.values()) == accepted
    assert all(v == 0 for p, v in per_pos.items() if p >= TREE["max_depth"]), per_pos
    assert per_pos.get(0, 0) > 0


def test_plugin_registered_in_every_server_process(server, client):
    """The plugin hook ran in the API server, the engine core and the worker."""
    _completion(client, 0)
    lines = server.registry_path.read_text().splitlines()
    pids = {line.split()[0] for line in lines}
    assert len(pids) >= 3, lines
    assert server.proc.poll() is None, server.log_tail()
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_tail()
