"""The verifier's deterministic mode (--deterministic) is refused where it cannot hold, and `ddtree serve` hands it to
the verifier. Its bitwise equalities are checked through Triton's interpreter (interpreted_engines.py
check_deterministic)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from ddtree.cli import build_parser
from ddtree.serve import commands
from kernels.invariant import invariant_supported
from tests.conftest import make_hybrid_target
from verify_server.config import VerifyServerConfig
from verify_server.step_attention import INVARIANT
from verify_server.verify import VerifyEngine, load_target


def test_config_refuses_what_the_mode_cannot_run(tmp_path: Path) -> None:
    target = str(tmp_path)
    for settings, given in (({"tp": 2}, "--tp > 1"), ({"eager": True}, "--eager"), ({"compile": True}, "--compile")):
        with pytest.raises(ValueError, match=f"--deterministic .* not with {given}"):
            VerifyServerConfig(target=target, deterministic=True, **settings)
    on = VerifyServerConfig(target=target, deterministic=True, device="cuda")  # compiled by default on a GPU, not so
    assert not on.compiles and VerifyServerConfig(target=target, device="cuda").compiles
    parser = argparse.ArgumentParser()
    VerifyServerConfig.add_arguments(parser)
    assert VerifyServerConfig.from_args(parser.parse_args(["--target", target, "--deterministic"])).deterministic
    assert not VerifyServerConfig.from_args(parser.parse_args(["--target", target])).deterministic


def test_engine_refuses_targets_and_devices_without_the_kernels(qwen3_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the fused path .*generic HF path"):
        VerifyEngine(load_target(qwen3_target), fused=False, graphs=False, attention=INVARIANT)
    hybrid = load_target(make_hybrid_target("qwen3_5", tmp_path / "hybrid"))
    with pytest.raises(ValueError, match="needs the fused path .*model_type 'qwen3_5_text'"):
        VerifyEngine(hybrid, attention=INVARIANT)
    if invariant_supported(torch.device("cpu"), 16):
        pytest.skip("Triton's interpreter is on: the CPU runs the mode (interpreted_engines.py)")
    with pytest.raises(ValueError, match="needs a CUDA GPU with Triton"):
        VerifyEngine.from_pretrained(qwen3_target, attention=INVARIANT)


def test_serve_hands_the_mode_to_the_verifier() -> None:
    for flags, wanted in (([], False), (["--deterministic"], True)):
        services = commands(build_parser().parse_args(["serve", *flags]))
        verify = services["verify"]
        assert build_parser().parse_args(verify[verify.index("verify"):]).deterministic is wanted
        assert "--deterministic" not in services["draft"] + services["gateway"]
    for flags in (["--compile"], ["--eager"], ["--tp", "2"]):
        with pytest.raises(SystemExit, match="--deterministic runs the verifier on one GPU"):
            commands(build_parser().parse_args(["serve", "--deterministic", *flags]))
