"""Checkpoint pieces, files and disks in one process: the N-D chunks of a flat range, pruning
across a change in digit count, a save onto a disk that really fills up."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aligndp
from aligndp.state.checkpoint import prune_checkpoints


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 5), max_size=4), data=st.data())
def test_flat_range_chunks_tile_the_range_in_flat_order(shape, data):
    """Read through torch indexing, the blocks give back exactly the elements [lo, hi) in order;
    at most 2 * ndim - 1 of them."""
    from aligndp.state.dcp_io import flat_range_chunks

    n = math.prod(shape)
    lo = data.draw(st.integers(0, n), label="lo")
    hi = data.draw(st.integers(lo, n), label="hi")
    full = torch.arange(n).view(shape)
    chunks = flat_range_chunks(lo, hi, tuple(shape))
    read = [
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        for offsets, sizes in chunks
    ]
    assert torch.equal(torch.cat([torch.zeros(0, dtype=torch.long), *read]), torch.arange(lo, hi))
    assert len(chunks) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize(
    "steps", [(98, 99, 100, 101), (999_998, 999_999, 1_000_000, 1_000_001)], ids=["short", "cli"]
)
def test_prune_keeps_the_numerically_newest_across_a_change_in_digit_count(tmp_path, steps):
    """``step-99`` sorts after ``step-100`` as text; the newest by number are kept (the CLI's
    ``step-{step:06d}`` names change digit count at a million)."""
    names = [f"step-{s:06d}" for s in steps]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "aligndp.json").write_text("{}")
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(os.path.basename(p) for p in deleted) == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


# ---- a real full disk ----

CHILD = r"""
import json, os, resource, signal, sys
import torch, torch.distributed as dist, torch.nn as nn
import aligndp

where, limit = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 1000), nn.Linear(1000, 10))  # ~3.7 MB with AdamW state
    return aligndp.parallelize(net, sharding="zero1", lr=0.1)


def step(model, opt):
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    opt.zero_grad()


model, opt = build()
step(model, opt)
path = os.path.join(where, "ckpt")
aligndp.save(path, model, opt, step=1)
saved = [p.detach().clone() for p in model.module.parameters()]
step(model, opt)
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    aligndp.save(path, model, opt, step=2)
    error = None
except BaseException as e:
    error = [type(e).__name__, str(e)]
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
fresh, fresh_opt = build()
loaded = aligndp.load(path, fresh, fresh_opt)
kept = all(torch.equal(p, q) for p, q in zip(fresh.module.parameters(), saved))
print(json.dumps({"error": error, "loaded": loaded, "kept": kept, "left": os.listdir(where)}))
"""


def save_twice_onto(where: str, limit: int) -> dict:
    """Run CHILD: save, then save again onto ``where`` (each file limited to ``limit`` bytes
    when > 0), then load; its report."""
    src = os.path.dirname(os.path.dirname(aligndp.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, where, str(limit)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_one_oserror_line(report: dict, reason: str) -> None:
    kind, text = report["error"]
    assert kind == "OSError" and "\n" not in text, report["error"]
    assert reason in text and "nothing was left behind" in text, text
    assert report["loaded"] == 1 and report["kept"], "the previous checkpoint did not survive"
    assert report["left"] == ["ckpt"], f"left on the disk: {report['left']}"


def test_a_file_size_limit_mid_save_is_one_oserror_line(tmp_path):
    """RLIMIT_FSIZE (any user, any machine): the shard write fails part-way inside torch's zip
    writer, which reports ``unexpected pos``; the promise is one OSError line."""
    report = save_twice_onto(str(tmp_path), limit=1 << 20)
    assert_one_oserror_line(report, "a file would exceed the size limit")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 6 MiB tmpfs (root only; skipped where mounting is impossible)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:200]}")
    yield str(where)
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_tmpfs_mid_save_is_one_oserror_line(small_tmpfs):
    """The first save fits in 6 MiB, the second runs out of space part-way."""
    report = save_twice_onto(small_tmpfs, limit=0)
    assert_one_oserror_line(report, "no space left on the device")


def test_corruption_anywhere_in_a_file_of_several_read_blocks_changes_its_checksum(tmp_path):
    """Issue 42, planted bug: a checkpoint file larger than one read block (8 MiB) is checked
    over every block, so one flipped byte in its first block, in the middle, or in its last
    byte is found at load (``file_checksum`` is what load compares)."""
    from aligndp.state.checkpoint_files import file_checksum

    path = tmp_path / "__0_0.distcp"
    size = (1 << 23) * 2 + 12345
    data = bytearray(os.urandom(size))
    path.write_bytes(data)
    clean = file_checksum(str(path))
    for where in (0, 1 << 23, size // 2, size - 1):
        data[where] ^= 0xFF
        path.write_bytes(data)
        assert file_checksum(str(path)) != clean, f"a flipped byte at {where} went unseen"
        data[where] ^= 0xFF
    path.write_bytes(data)
    assert file_checksum(str(path)) == clean
