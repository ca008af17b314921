"""`streamload --version` and `streamload inspect` do not import torch (seconds on a loaded
machine): only the Loader (in the demo's ranks, not in the demo's own process) and calibrate
need it. Checked in a fresh interpreter, since this one has imported torch long ago."""
from __future__ import annotations

import subprocess
import sys

import pytest

from corpus import write_jsonl_source

CHECK = """
import sys
from streamload.commands.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:   # --version exits from argparse
    status = exit.code
heavy = sorted(m for m in ("torch", "torch.distributed") if m in sys.modules)
print("imported:", heavy, file=sys.stderr)
sys.exit(status or (3 if heavy else 0))
"""


# The demo too: tests/test_cli.py runs each of its demos through CHECK (one demo run less).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [
    ["--version"], ["inspect", "{tmp}/web"], ["inspect", "--help"]],
    ids=["version", "inspect", "inspect-help"])
def test_command_does_not_import_torch(tmp_path, command):
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=20, seed=1)
    argv = [part.format(tmp=tmp_path) for part in command]
    proc = subprocess.run([sys.executable, "-c", CHECK, *argv], capture_output=True, text=True,
                          timeout=280)
    assert "imported: []" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if command[0] == "inspect" and command[1] != "--help":
        assert "2 shard(s)" in proc.stdout, proc.stdout


def test_the_package_gives_its_torch_names_on_first_use():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, streamload as sl; assert 'torch' not in sys.modules; "
                           "sl.Loader, sl.Batch, sl.MicroBatch; assert 'torch' in sys.modules; "
                           "assert {'Loader', 'Batch', 'MicroBatch'} <= set(dir(sl)); "
                           "from streamload import *"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
