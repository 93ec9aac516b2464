"""Content hashes of stored rows (issue 13, item 7): a flipped bit in a part, or a truncated
samples.parquet, is found and never read back as data. Parts whose bytes do not hash to their
line in samples/_checksums.jsonl are skipped (readers) or quarantined and redone (a resume);
a damaged samples.parquet is rebuilt from the parts with a warning."""
from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest

from evalrun.results import RunStore, read_manifest, read_samples, samples_file_intact
from evalrun.results.checksums import load_index, sha256_file
from evalrun.results.schema import CHECKSUMS_FILE, QUARANTINE_PREFIX, SAMPLES_DIR, SAMPLES_FILE
from evalrun.results.samples_read import _collect

KEYS = ["subject", "qid"]
MANIFEST = {"identity": {"task": "mmlu", "model_fingerprint": "m", "tokenizer_fingerprint": "t"}}


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"subject": "s", "qid": i, "prediction": "ABCD"[i % 4], "correct": i % 3 == 0, "score": i / 7}
            for i in range(start, start + n)]


def _one_part_run(run_dir: Path, n: int = 6) -> Path:
    with RunStore.open(run_dir, MANIFEST, KEYS) as store:
        for row in _rows(n):
            store.add(row)
    (part,) = sorted((run_dir / SAMPLES_DIR).glob("part-*.parquet"))
    return part


def _finished_run(run_dir: Path, n: int = 10) -> Path:
    """A finalized run of n rows in parts of 4."""
    with RunStore.open(run_dir, MANIFEST, KEYS, flush_rows=4) as store:
        for row in _rows(n):
            store.add(row)
        store.finalize()
    return run_dir


def test_every_part_has_its_hash_recorded_before_it_is_published(tmp_path):
    run = tmp_path / "run"
    with RunStore.open(run, MANIFEST, KEYS, flush_rows=2) as store:
        for row in _rows(5):
            store.add(row)
    parts = sorted((run / SAMPLES_DIR).glob("part-*.parquet"))
    assert len(parts) == 3
    assert load_index(run / SAMPLES_DIR) == {p.name: sha256_file(p) for p in parts}


def test_every_single_bit_flip_of_a_part_is_caught(tmp_path):
    """All 8 x size flips: each is skipped, none reads back as (changed) rows. Without the index
    some flips do read back changed, which is what this guards against."""
    run = tmp_path / "run"
    part = _one_part_run(run)
    good = part.read_bytes()
    original = read_samples(run)
    caught, silent_without_index = 0, 0
    index_file = run / SAMPLES_DIR / CHECKSUMS_FILE
    index_text = index_file.read_text()
    for bit in range(8 * len(good)):
        flipped = bytearray(good)
        flipped[bit // 8] ^= 1 << (bit % 8)
        part.write_bytes(bytes(flipped))
        torn: list[Path] = []
        tables, _ = _collect(run, torn.append)
        assert torn == [part] and tables == []
        caught += 1
        if bit % 13 == 0:                      # the same flip with the index gone (a run before checksums)
            index_file.unlink()
            tables, _ = _collect(run, lambda p: None)
            try:
                silent_without_index += bool(tables) and not tables[0].to_pandas().equals(original)
            except (UnicodeDecodeError, ValueError):      # garbled metadata: at least not silent
                pass
            index_file.write_text(index_text)
    assert caught == 8 * len(good)
    assert silent_without_index > 0            # the hole is real without hashes
    part.write_bytes(good)
    pd.testing.assert_frame_equal(read_samples(run), original)


def test_a_resume_quarantines_a_damaged_part_and_redoes_its_rows(tmp_path):
    run = tmp_path / "run"
    part = _one_part_run(run)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x10
    part.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="torn or damaged sample part"):
        store = RunStore.open(run, MANIFEST, KEYS)
    with store:
        assert store.completed_keys() == set()                      # its rows are to be redone
        assert (run / SAMPLES_DIR / (QUARANTINE_PREFIX + part.name)).exists() and not part.exists()
        for row in _rows(6):
            store.add(row)
        store.finalize()
    assert len(read_samples(run)) == 6


def test_a_truncated_samples_file_is_found_and_rebuilt_from_the_parts(tmp_path):
    run = _finished_run(tmp_path / "run")
    assert samples_file_intact(run) and read_manifest(run)["samples_sha256"] == sha256_file(run / SAMPLES_FILE)
    expected = read_samples(run)
    full = (run / SAMPLES_FILE).read_bytes()
    for damage in ("truncate", "flip"):
        if damage == "truncate":
            (run / SAMPLES_FILE).write_bytes(full[: len(full) - 100])
        else:
            flipped = bytearray(full)
            flipped[len(full) // 3] ^= 0x01
            (run / SAMPLES_FILE).write_bytes(bytes(flipped))
        assert not samples_file_intact(run)
        with pytest.warns(UserWarning, match="samples.parquet is damaged"):
            pd.testing.assert_frame_equal(read_samples(run), expected)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with RunStore.open(run, MANIFEST, KEYS) as store:
                store.finalize()
        assert samples_file_intact(run)
        pd.testing.assert_frame_equal(read_samples(run), expected)


def test_a_run_from_before_checksums_is_read_unverified(tmp_path):
    run = tmp_path / "run"
    _one_part_run(run)
    (run / SAMPLES_DIR / CHECKSUMS_FILE).unlink()
    assert len(read_samples(run)) == 6
    with RunStore.open(run, MANIFEST, KEYS) as store:              # resumed: new parts are not indexed
        store.add(_rows(1, start=6)[0])
    assert not (run / SAMPLES_DIR / CHECKSUMS_FILE).exists() and len(read_samples(run)) == 7


def test_evalrun_rebuilds_a_truncated_samples_file_of_a_finished_run(tiny_model_dir, tmp_path, capsys):
    from evalrun.commands.cli import main
    fixture = Path(__file__).resolve().parent / "data" / "mmlu"
    argv = ["mmlu", "--no-progress", "--model", str(tiny_model_dir), "--data-dir", str(fixture), "--limit", "2",
            "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    samples = tmp_path / "run" / SAMPLES_FILE
    before = pd.read_parquet(samples)
    samples.write_bytes(samples.read_bytes()[:-50])
    with pytest.warns(UserWarning, match="samples.parquet is damaged"):
        assert main(argv) == 0                                          # nothing to run: rebuilt, not trusted
    assert "nothing to run" in capsys.readouterr().err
    assert samples_file_intact(tmp_path / "run")
    pd.testing.assert_frame_equal(pd.read_parquet(samples), before)


def test_compare_refuses_a_damaged_samples_file(tmp_path):
    from evalrun.results.errors import RunReadError
    from evalrun.results.run_reader import load_finished_run
    run = _finished_run(tmp_path / "run")
    assert len(load_finished_run(run).rows) == 10
    data = bytearray((run / SAMPLES_FILE).read_bytes())
    data[len(data) // 2] ^= 0x04
    (run / SAMPLES_FILE).write_bytes(bytes(data))
    with pytest.raises(RunReadError, match="do not match the hash in its manifest"):
        load_finished_run(run)
