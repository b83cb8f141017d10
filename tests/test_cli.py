"""`k3 inspect` end to end (k3_compile.cli.main)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3_compile.cli import main

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"
REAL = Path("/work/shared/reference-configs/kimi-k3.config.json")
if not REAL.is_file():
    REAL = ROOT.parent / "shared" / "reference-configs" / "kimi-k3.config.json"


def _line(out: str, start: str) -> str:
    return next(ln for ln in out.splitlines() if ln.strip().startswith(start))


@pytest.mark.skipif(not REAL.is_file(), reason="reference K3 config not available")
def test_inspect_real_config(capsys):
    assert main(["inspect", str(REAL)]) == 0
    out = capsys.readouterr().out
    assert "93  = 69 KDA + 24 MLA  (1 dense MLP, 92 MoE)" in _line(out, "layers:")
    assert _line(out, "MLA (0-based):").endswith("3,7,11,15,19,23,27,31,35,39,43,47,51,55,59,63,67,71,75,79,83,87,91-92")
    assert _line(out, "total").split()[1] == "2.78T"
    assert "8 blocks" in _line(out, "AttnRes:")
    assert "checkpoint:     none (config only: no weights checked)" in out  # a bare config.json: no shards to check


def test_inspect_k3_nano(capsys):
    assert main(["inspect", str(NANO)]) == 0
    out = capsys.readouterr().out
    assert "8  = 6 KDA + 2 MLA  (1 dense MLP, 7 MoE)" in _line(out, "layers:")
    assert _line(out, "kinds:").split()[1:] == ["KDA+dense", "KDA", "KDA", "MLA", "KDA", "KDA", "KDA", "MLA"]
    assert _line(out, "KDA (0-based):").endswith("0-2,4-6")
    assert _line(out, "total").split()[1:3] == ["31.63M", "(31,634,924)"]
    assert _line(out, "checkpoint:") == ("checkpoint:     2 shard(s), 1556 tensors, all present with the "
                                         "expected shapes and dtypes")


def test_inspect_bad_config_one_line_error(tmp_path, capsys):
    raw = json.loads((NANO / "config.json").read_text())
    raw["text_config"]["num_experts_per_token"] = 64
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    assert main(["inspect", str(p)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.count("\n") == 1 and "Traceback" not in cap.err
    assert cap.err.startswith("k3 inspect: error: ")
    assert "num_experts_per_token' = 64 must be in 1..num_experts (32)" in cap.err


def test_inspect_invalid_json_and_missing(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid JSON" in err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_inspect_bad_checkpoint_exit_2(tmp_path, capsys):
    d = tmp_path / "nano"
    d.mkdir()
    for f in NANO.iterdir():
        if f.name != "model-00002-of-00002.safetensors":
            shutil.copy(f, d / f.name)
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "names shard file(s) that do not exist: model-00002-of-00002.safetensors" in err
