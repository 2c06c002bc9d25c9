"""Data for `aligndp train`: the synthetic language, files, and batches as functions of
(seed, step)."""

import re

import numpy as np
import pytest
import torch

from aligndp.app.data import BatchSpec, TokenData, arithmetic_text


def test_arithmetic_text_is_deterministic_and_every_sum_is_right():
    text = arithmetic_text(5000, seed=3)
    assert len(text) == 5000
    assert text == arithmetic_text(5000, seed=3)
    assert text != arithmetic_text(5000, seed=4)
    equations = text.decode().split(";")[:-1]  # the last one may be cut off
    assert len(equations) > 400
    for eq in equations:
        a, b, c = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", eq).groups())
        assert a + b == c and 0 <= a <= 99 and 0 <= b <= 99


def test_synthetic_data_is_byte_level_with_a_held_out_tail():
    data = TokenData.synthetic(num_bytes=10_000)
    assert data.vocab_size == 256 and len(data) == 10_000
    assert len(data.splits["eval"]) == 1000
    # train then eval, in order, covering the stream exactly once
    np.testing.assert_array_equal(
        np.concatenate([data.splits["train"], data.splits["eval"]]), data.tokens
    )
    assert set(np.unique(data.tokens).tolist()) <= set(b"0123456789+=;")


def _global_batch(data, spec, step, seed=0, split="train"):
    """The whole global batch as one process reads it (1 rank, 1 micro-batch)."""
    one = BatchSpec(spec.batch_size, spec.seq_len)
    return data.batch(step, one, seed=seed, split=split)


def test_batch_is_a_function_of_seed_and_step():
    data = TokenData.synthetic(num_bytes=20_000)
    spec = BatchSpec(batch_size=4, seq_len=16)
    a = data.batch(7, spec, seed=1)
    b = data.batch(7, spec, seed=1)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, data.batch(8, spec, seed=1).inputs)
    assert not torch.equal(a.inputs, data.batch(7, spec, seed=2).inputs)
    assert not torch.equal(a.inputs, data.batch(7, spec, seed=1, split="eval").inputs)


def test_rows_are_windows_of_the_stream_and_targets_are_shifted_by_one():
    data = TokenData.synthetic(num_bytes=20_000)
    spec = BatchSpec(batch_size=3, seq_len=10)
    batch = data.batch(0, spec, seed=0)
    offsets = data.offsets(0, batch_size=3, seq_len=10, seed=0)
    tokens = torch.from_numpy(data.splits["train"].astype(np.int64))
    for row, start in enumerate(offsets.tolist()):
        assert torch.equal(batch.inputs[row], tokens[start : start + 10])
        assert torch.equal(batch.targets[row], tokens[start + 1 : start + 11])
    assert batch.inputs.dtype == torch.int64 and batch.inputs.shape == (3, 10)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_rank_and_micro_batch_slices_concatenate_to_the_global_batch(dp_size, micro_batches):
    data = TokenData.synthetic(num_bytes=20_000)
    spec = BatchSpec(batch_size=12, seq_len=8, dp_size=dp_size, micro_batches=micro_batches)
    for step in (0, 5):
        parts = [
            data.batch(step, spec, seed=4, rank=r, micro_batch=m)
            for r in range(dp_size)
            for m in range(micro_batches)
        ]
        assert all(p.inputs.shape == (12 // (dp_size * micro_batches), 8) for p in parts)
        whole = _global_batch(data, spec, step, seed=4)
        assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)


def test_rows_of_rank_and_micro_batch_by_hand():
    spec = BatchSpec(batch_size=12, seq_len=8, dp_size=3, micro_batches=2)
    assert spec.rows(0, 0) == range(0, 2)
    assert spec.rows(1, 1) == range(6, 8)
    assert spec.rows(2, 1) == range(10, 12)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        spec.rows(3, 0)


def test_bin_file_is_memory_mapped_uint16(tmp_path):
    ids = (np.arange(3000, dtype=np.int64) * 7919 % 50257).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    data = TokenData.from_file(path)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(data.tokens), ids)
    spec = BatchSpec(batch_size=2, seq_len=16)
    batch = data.batch(1, spec, seed=0)
    start = data.offsets(1, batch_size=2, seq_len=16, seed=0)[0].item()
    assert batch.inputs[0].tolist() == ids[start : start + 16].tolist()
    data.check(seq_len=16, vocab_size=50257)
    with pytest.raises(
        ValueError, match=r"token id 50\d\d\d does not fit the model's vocab_size=256"
    ):
        data.check(seq_len=16, vocab_size=256)


def test_token_ids_past_the_scanned_head_are_caught_by_the_batch(tmp_path, monkeypatch):
    """check() scans only the head of a large file; a batch row with a bigger id still raises."""
    monkeypatch.setattr("aligndp.app.data.VOCAB_SCAN_TOKENS", 100)
    ids = np.full(2000, 7, dtype=np.uint16)
    ids[1000:] = 300  # past the scanned head, too big for a byte vocabulary
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    data = TokenData.from_file(path)
    data.check(seq_len=16, vocab_size=256)
    spec = BatchSpec(batch_size=64, seq_len=16)
    with pytest.raises(ValueError, match="token id 300 does not fit the model's vocab_size=256"):
        data.batch(0, spec, seed=0)


def test_text_file_is_byte_level(tmp_path):
    path = tmp_path / "poem.txt"
    text = "Tyger Tyger, burning bright, in the forests of the night; ünïcode too.\n" * 20
    path.write_text(text, encoding="utf-8")
    data = TokenData.from_file(path)
    assert data.vocab_size == 256
    assert bytes(data.tokens) == text.encode("utf-8")
    data.check(seq_len=32, vocab_size=256)


def test_file_too_small_for_one_batch_says_how_big_it_must_be(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 300)
    data = TokenData.from_file(path)
    # 300 bytes: eval split is 30 tokens, one sequence of 64 needs 65
    with pytest.raises(
        ValueError, match=r"eval split has 30 tokens.*seq_len \+ 1 = 65.*at least 650 tokens"
    ):
        data.check(seq_len=64, vocab_size=256)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the file is empty"),
        (b"\x01\x02\x03", "not a whole number of uint16 tokens"),
    ],
)
def test_bad_bin_files(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        TokenData.from_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        TokenData.from_file(tmp_path / "nope.txt")


def test_batch_not_divisible_names_the_parts_and_a_fix():
    with pytest.raises(
        ValueError,
        match=r"batch size 10 does not split into 2 rank\(s\) x 3 micro-batch\(es\) = 6 equal parts"
        r".*\(e\.g\. 12 or 6\)",
    ):
        BatchSpec(batch_size=10, seq_len=8, dp_size=2, micro_batches=3)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        BatchSpec(batch_size=4, seq_len=0)
