"""Models named as users name them: a directory, or a hub id found in the local Hugging Face cache (never
downloaded); EOS ids from config.json and generation_config.json; a drafter that does not fit its target refused by
the commands before anything loads, and by a gateway that meets the two as separate services."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.health import Backends
from runtime.models import check_fit, read_eos_ids, resolve_model
from tests.conftest import make_drafter, make_target
from tests.gateway_support import ServiceVerifier, chat_ids, local_backends, make_chat_target, metric, reference
from tests.services import REPO_ROOT
from verify_server.verify import VerifyEngine

DEMO = REPO_ROOT / "models" / "demo"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE")


def fake_cache(hub: Path, repo_id: str, source: Path) -> Path:
    """A Hugging Face hub cache holding `source` as the snapshot of repo_id's main branch, laid out as the hub
    client writes it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**clean, **env})


def generate(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run("-m", "ddtree.cli", "generate", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8", "--json", *args,
               **env)


def bad_drafter(tmp_path: Path, **changes) -> Path:
    """A copy of the demo drafter whose config.json is edited: `changes` top level, dflash_config's keys too."""
    drafter = tmp_path / "drafter"
    shutil.copytree(DEMO / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    for key, value in changes.items():
        (config["dflash_config"] if key in config["dflash_config"] else config)[key] = value
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


def test_generate_finds_hub_ids_in_the_local_cache(tmp_path) -> None:
    hub = tmp_path / "hub"
    fake_cache(hub, "acme/demo-target", DEMO / "target")
    fake_cache(hub, "acme/demo-drafter", DEMO / "drafter")
    out = generate("--target", "acme/demo-target", "--drafter", "acme/demo-drafter", HF_HUB_CACHE=str(hub))
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[-1])["token_ids"]) == 8


def test_hf_home_is_searched_and_a_missing_id_names_the_cache(tmp_path) -> None:
    home = tmp_path / "home"
    snapshot = fake_cache(home / "hub", "acme/demo-target", DEMO / "target")
    out = run("-c", "import argparse\n"
                    "from runtime.models import resolve_model, resolve_pair\n"
                    "from verify_server.config import VerifyServerConfig\n"
                    "print(resolve_model('acme/demo-target'))\n"
                    "parser = argparse.ArgumentParser()\n"
                    "VerifyServerConfig.add_arguments(parser)\n"
                    "config = VerifyServerConfig.from_args(parser.parse_args(['--target', 'acme/demo-target']))\n"
                    "print(config.served_name, flush=True)\n"
                    "resolve_pair('acme/absent', None)", HF_HOME=str(home))
    assert out.stdout.split() == [str(snapshot), "acme/demo-target"], out.stderr  # served under its hub id
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "acme/absent" in out.stderr and str(home / "hub" / "models--acme--absent") in out.stderr
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-dir"))


def test_eos_ids_include_generation_config(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DEMO / "target" / "config.json", model)  # eos_token_id 2
    assert read_eos_ids(model) == [2]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert read_eos_ids(model) == [2, 7]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_eos_ids(model) == [2, 5]


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 256}, "hidden size is 256, the target's 384"),
    ({"vocab_size": 1000}, "vocabulary has 1000 tokens, the target's 8192"),
    ({"target_layer_ids": [1, 3, 6]}, "taps target layer 6, the target has 6 layers"),
    ({"mask_token_id": 8192}, "mask token id 8192 is outside"),
])
def test_check_fit_names_the_mismatch(tmp_path, changes, message) -> None:
    check_fit(DEMO / "target", DEMO / "drafter")
    with pytest.raises(ValueError, match=message):
        check_fit(DEMO / "target", bad_drafter(tmp_path, **changes))


def test_commands_refuse_a_drafter_that_does_not_fit(tmp_path) -> None:
    drafter = bad_drafter(tmp_path, target_layer_ids=[1, 3, 6])
    for out in (generate("--drafter", str(drafter)),
                run("-m", "ddtree.cli", "serve", "--target", str(DEMO / "target"), "--drafter", str(drafter))):
        assert out.returncode != 0
        assert "taps target layer 6, the target has 6 layers" in out.stderr and "Traceback" not in out.stderr
        assert "[verify]" not in out.stdout  # refused before any service started


def test_gateway_decodes_autoregressively_past_a_drafter_that_does_not_fit(tmp_path) -> None:
    """The verifier serves a 2-layer target; the drafter service (the verifier's too) taps layer 2 of the 4-layer
    target it was made for."""
    chat_target = make_chat_target(tmp_path / "chat")
    drafter = local_backends(chat_target, make_drafter(tmp_path / "drafter")).drafter
    short = make_target("qwen3", tmp_path / "short", layers=2)
    backends = Backends(ServiceVerifier(VerifyEngine.from_pretrained(short), drafter), drafter)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
               "temperature": 0}

    async def ask() -> tuple[httpx.Response, httpx.Response, str, str]:
        app = create_app(GatewayConfig(target=str(chat_target)), backends)
        tokenizer = app.state.service.tokenizer
        async with app.router.lifespan_context(app):
            await app.state.service.monitor.check()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
                health = await client.get("/health")
                reply = await client.post("/v1/chat/completions", json=request)
                metrics = (await client.get("/metrics")).text
        expected = (await reference(backends, tokenizer, chat_ids(tokenizer, request["messages"]), 12))[0]
        return health, reply, metrics, expected

    health, reply, metrics, expected = asyncio.run(ask())
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["drafter"] == "unfit"
    assert "taps target layer 2, the target has 2 layers" in health.json()["reason"]
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected
    assert metric(metrics, "ddtree_spec_drafts_total") == 0
